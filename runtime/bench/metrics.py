"""The benchmark's derived figures and the measurements behind them.

- theoretical_speedup: Leviathan et al. (2023), eq. for the expected walltime improvement,
  (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a the per-token acceptance probability.
- alpha_from_tokens_per_round: that per-token probability from the mean tokens per round at
  a fixed k (for modes that report no per-token counts; tandem's rounds count the draft
  tokens they tested, so its alpha is kept / tested exactly).
- copy_bandwidth: bytes moved (read + written) per second by a large on-device copy.
- weight_bytes_per_step: the target's weight bytes one decode step reads.
- kv_bytes_per_position: the KV bytes one position holds over all the layers (a decode step
  at context L reads L of them a row): with the weights, the byte limit of long contexts.
- step_time: seconds of one forward_extend of our model code (a decode or verify step);
  on CPU timed with the threads an engine worker gets (worker_cpu_threads, cpu_threads).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding over the target alone at per-token acceptance
    alpha, draft length k and cost ratio c (draft step / target step)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 1 or c < 0:
        raise ValueError(f"need k >= 1 and c >= 0, got k={k}, c={c}")
    tokens_per_round = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens_per_round / (k * c + 1.0)


def theoretical_overlap_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of overlapped speculation (greedy; runtime.worker.overlap) over the
    same k without overlap, both in units of a target verify: a plain round costs 1 + k·c; an
    overlapped one max(1, (k+1)·c), plus k·c of drafting afresh when its next window was not
    kept (it is with probability alpha^(k+1)). Both commit the same tokens a round."""
    theoretical_speedup(alpha, k, c)  # the same argument checks
    kept = alpha ** (k + 1)
    return (1.0 + k * c) / (max(1.0, (k + 1) * c) + (1.0 - kept) * k * c)


def alpha_from_tokens_per_round(mean_tokens: float, k: int) -> float:
    """Solve (1 - a^(k+1)) / (1 - a) = mean_tokens for a in [0, 1] (bisection); used when the
    per-position counts are not available."""
    target = min(max(mean_tokens, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceClock:
    """Seconds from `start()` to `mark()` as the device reaches them, without waiting for the
    device at `mark()`; read `seconds()` after a later synchronisation. On CPU, host time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else []
        self.host: list[float] = []

    def start(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            self.events[0].record()

    def mark(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.host.append(time.perf_counter())

    def seconds(self) -> float:
        if self.cuda:
            return self.events[0].elapsed_time(self.events[1]) / 1000.0
        return self.host[1] - self.host[0]


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes per second moved by `dst.copy_(src)` of a large tensor on `device`, counting both
    the bytes read and the bytes written (2 x size per copy), i.e. the achievable memory
    traffic a weight-streaming decode step competes with."""
    if nbytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(2 << 30, free // 8)
        else:
            nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - start) / iters
    del src, dst
    return 2.0 * nbytes / seconds


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters that one decode step reads: every parameter once
    (shared ones once), at its stored size (FP8 weights 1 byte a value, their float32 scales,
    the LM head in its dtype), except an untied input embedding, of which a step reads only a
    few rows. KV-cache reads are not counted (small next to the weights at these lengths)."""
    seen: dict[int, tuple[str, int]] = {}
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = p.data_ptr()
        owners.setdefault(key, []).append(name)
        seen[key] = (name, p.numel() * p.element_size())
    total = 0
    for key, (_, nbytes) in seen.items():
        names = owners[key]
        if all("embed_tokens" in n or n.endswith("wte.weight") for n in names):
            continue  # untied input embedding: one row per token
        total += nbytes
    return total


def kv_bytes_per_position(model: torch.nn.Module) -> int:
    """Bytes of K and V (and an FP8 cache's scales) one position holds in all of the model's
    KV caches (this rank's heads): a decode step reads this many per attended position."""
    total = 0
    for module in model.modules():
        cache = getattr(module, "kv_cache", None)
        if cache is None or not hasattr(cache, "k_cache"):
            continue
        heads_dim = cache.k_cache[0, :, 0]  # [Hkv, D]
        total += 2 * heads_dim.numel() * heads_dim.element_size()
        if cache.fp8:
            total += 2 * cache.k_scale[0, :, 0].numel() * cache.k_scale.element_size()
    return total


def worker_cpu_threads(
    draft_device: torch.device, target_devices: list[torch.device]
) -> int | None:
    """The torch threads each CPU worker of a spec engine with these devices gets (its equal
    share of the cores, runtime.worker.process); None when a device is not the CPU."""
    devices = [draft_device, *target_devices]
    if any(d.type != "cpu" for d in devices):
        return None
    workers = len(dict.fromkeys(str(d) for d in devices))
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, cores // workers)


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int | None):
    """Run with `threads` torch threads on the CPU (nothing changes on a GPU or for None)."""
    before = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def step_time(
    runner,
    device: torch.device,
    batch: int,
    tokens: int,
    position: int,
    iters: int = 20,
    warmup: int = 3,
) -> float:
    """Median seconds of one step of `tokens` tokens per row for `batch` rows through a
    runtime.models.runners.step_runner.StepRunner (the workers' path: static shapes, CUDA graphs on
    CUDA), written at cache position `position` (the cache must hold batch slots of
    position + tokens). Each step is timed on its own (a sync after each): one step slowed
    by a busy host moves a mean, not the median."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, runner.model.vocab_size, (batch, tokens), generator=gen).to(device)
    slots, starts, n = list(range(batch)), [position] * batch, [tokens] * batch
    for _ in range(warmup):
        runner.run(ids, slots, starts, n)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        runner.run(ids, slots, starts, n)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
