"""Per-phase wall times of a worker's round, for TANDEM_PROFILE=1."""
from __future__ import annotations

import time

import torch


class StepClock:
    """Wall time of each phase of a round (synchronising the device first), when profiling
    (TANDEM_PROFILE=1); free otherwise."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.laps: dict[str, float] = {}
        self._last = self._now() if enabled else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        if self.enabled:
            now = self._now()
            self.laps[name] = now - self._last
            self._last = now
