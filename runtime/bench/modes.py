"""The benchmark's modes. Each one generates greedily from the same prompts and reports the
generated tokens and the wall time of the whole call (prefill and first token included).

- `target`  (TandemTarget): the target alone through tandem's own model code, in this process:
  runtime.models.load_model, allocate_cache, the prompt, then one step per token with argmax
  on the device, through the workers' StepRunner (CUDA graphs on CUDA, no host sync). No
  orchestrator, no worker, no draft: the decode speed of tandem's model code, which a
  speculation round builds on. With --quantization fp8 it (and `spec`) runs FP8 weights;
  the transformers modes keep the float weights (their rows say so).
- `spec`    (TandemSpec): the tandem Engine (orchestrator + workers, spawn launch) running
  draft-target speculative decoding on the configured devices.
- `hf`, `hf-compiled` (HFGenerate): transformers `generate` of the target, eager with its
  dynamic cache, or with a static cache and transformers' automatic torch.compile of the
  decode step (CompileConfig mode "reduce-overhead" on CUDA, i.e. CUDA graphs).
- `hf-assisted` (HFAssisted): transformers assisted generation with the same draft,
  num_assistant_tokens = k, schedule "constant", no confidence early stop.

tandem's modes are in tandem_modes.py, the transformers ones in hf_modes.py; here is what
they share: the result of a call (Outcome), Skipped, and how calls are timed.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

MODES = ("target", "spec", "spec-sequential", "hf", "hf-compiled", "hf-assisted")


class Skipped(Exception):
    """This mode cannot run in this setting; str(exc) says why."""


@dataclass
class Outcome:
    tokens: int  # generated tokens, all rows
    wall_s: float  # the whole generate call
    acceptance_rate: float | None = None  # accepted draft tokens / proposed draft tokens
    mean_accepted_tokens: float | None = None  # tokens committed per round (incl. the target's)
    alpha: float | None = None  # per-token acceptance probability (see metrics)
    rounds: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(mode, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int) -> Outcome:
    """`warmup` untimed calls, then the median of `repeats` timed ones."""
    return timed_side_by_side({"mode": mode}, prompts, new_tokens, warmup, repeats)["mode"]


def timed_side_by_side(
    modes: dict, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int
) -> dict[str, Outcome]:
    """`timed` for modes loaded at once: each gets `warmup` untimed calls, then the timed
    calls take turns (A B, B A, A B, ...), so that a drifting host or a busy neighbour weighs
    on each alike; per mode the median of its `repeats` calls, and in its extra the
    tokens/s of every timed call in order (`call_tokens_per_s`)."""
    for mode in modes.values():
        for _ in range(warmup):
            mode.run(prompts, new_tokens)
    runs: dict[str, list[Outcome]] = {name: [] for name in modes}
    for i in range(repeats):
        for name in list(modes) if i % 2 == 0 else list(modes)[::-1]:
            runs[name].append(modes[name].run(prompts, new_tokens))
    medians = {}
    for name, outs in runs.items():
        median = sorted(outs, key=lambda o: o.wall_s)[(len(outs) - 1) // 2]
        median.extra["call_tokens_per_s"] = [o.tokens_per_s for o in outs]
        medians[name] = median
    return medians
