"""Per-phase wall times of a worker's round, for TANDEM_PROFILE=1."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Wall time of each phase of a round (synchronising the device first), when profiling
    (TANDEM_PROFILE=1); free otherwise. Beside each phase `<name>_s` it records the CPU time
    this thread spent in it as `<name>_cpu_s`: on a CPU device, wall time well above CPU
    time in a compute phase means the worker was waiting for a core (other processes)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.laps: dict[str, float] = {}
        self._last = self._now() if enabled else 0.0
        self._last_cpu = time.thread_time() if enabled else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        if self.enabled:
            now, cpu = self._now(), time.thread_time()
            self.laps[name] = now - self._last
            self.laps[name.removesuffix("_s") + "_cpu_s"] = cpu - self._last_cpu
            self._last, self._last_cpu = now, cpu
