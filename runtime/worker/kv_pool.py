"""How many KV blocks the pool holds: one number for every rank of the launch, since one
block table (rank 0's) addresses the draft's pool and the target's alike.

Each worker works out what it can hold, then all agree on the least (an all-reduce over the
bridge group, which spans every worker):

- `runtime.kv_cache_tokens` set: that many tokens (whole blocks), if they fit the budget;
- else per model: its `kv_cache_memory` share of the device's total memory, or (models without
  one) what the device has free after the weights, less a reserve for activations and CUDA
  graphs (runtime.models.runners.kv_budget.RESERVE, and the steps' logits: step_bytes),
  shared by the models of the rank; on a
  CPU worker at most max_batch_size requests of max_seq_len (memory there is everybody's).

A pool that cannot hold one request of max_seq_len (TandemConfig.kv_seq_len) is the config's
problem: a MemoryError naming the keys, which rank 0 reports as a usage error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from runtime.config import TandemConfig
from runtime.models.arch.cache import blocks_for
from runtime.models.runners.kv_budget import GIB, RESERVE, block_bytes, device_memory
from runtime.models.runners.prefill_runner import long_chunk_bytes

if TYPE_CHECKING:
    from runtime.models.arch.base import CausalLM


class PoolTooSmallElsewhere(Exception):
    """Another worker's budget makes the pool too small: that worker names the cause to
    rank 0; this one only waits to be shut down (runtime.worker.process)."""


def pool_blocks(
    config: TandemConfig,
    models: dict[str, CausalLM],
    device: torch.device,
    bridge: dist.ProcessGroup | None,
) -> int:
    """The pool's blocks on every rank. models: key ("draft"/"target") -> this rank's
    model of it. Collective over `bridge` (every worker calls it). A pool too small for one
    request: MemoryError on the workers whose budget made it so (naming the key), and
    PoolTooSmallElsewhere on the others."""
    rt = config.runtime
    per_request = blocks_for(config.kv_seq_len, rt.kv_block_size)
    local, owner, why = local_blocks(config, models, device, per_request)
    agreed = local
    if bridge is not None:
        count = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=bridge)
        agreed = int(count.item())
    if agreed >= per_request:
        return agreed
    if local >= per_request:
        raise PoolTooSmallElsewhere(f"another worker's KV budget holds {agreed} blocks")
    raise MemoryError(
        f"{owner} KV cache needs {per_request} blocks of {rt.kv_block_size} "
        f"tokens for one request of runtime.max_seq_len {rt.max_seq_len}, but "
        f"{why} holds {local}: raise it, or lower runtime.max_seq_len"
    )


def step_bytes(config: TandemConfig, model) -> int:
    """Memory a model's steps need beyond the reserve: logits of max_batch_size rows of a
    verify step (draft window + 1 positions) in float32, four times (the graphs' outputs, the
    runners' buffers, the sampling and acceptance work on them). 0.2 GiB at batch 8 for a
    128k vocabulary; at batch 256, 5 GiB: without it a pool sized to the 5% reserve left
    the CUDA graphs' capture out of memory (measured on an H200). Plus a long prompt chunk's
    activations (prefill_runner.long_chunk_bytes: about 0.9 GiB for an 8b model)."""
    rows = config.runtime.max_batch_size * (config.speculation.max_draft_len + 2)
    return 4 * rows * getattr(model, "vocab_size", 0) * 4 + long_chunk_bytes(model)


def local_blocks(
    config: TandemConfig, models: dict[str, CausalLM], device: torch.device, per_request: int
) -> tuple[int, str, str]:
    """(blocks this worker can hold, the model whose budget limits them, what limits them:
    for the error message)."""
    rt = config.runtime
    costs: dict[str, int] = {}  # per model: one block's bytes (None: no paged cache)
    for key, model in models.items():
        cost = block_bytes(model, rt.kv_block_size, rt.kv_cache_dtype)
        if cost is not None:
            costs[key] = cost
    first = next(iter(models), "target")
    if not costs:  # transformers fallback models keep a cache per slot
        return rt.max_batch_size * per_request, first, "the transformers fallback's slots"
    free, total = device_memory(device)
    budget = free - RESERVE * total - sum(step_bytes(config, model) for model in models.values())
    limits = []
    for key, cost in costs.items():
        share = getattr(config, key).kv_cache_memory
        if share is not None:
            limits.append(
                (
                    int(share * total // cost),
                    key,
                    f"{key}.kv_cache_memory {share} of {total / GIB:.1f} GiB",
                )
            )
            budget -= share * total
    shared = [key for key in costs if getattr(config, key).kv_cache_memory is None]
    if shared:
        limits.append(
            (
                max(0, int(budget // sum(costs[key] for key in shared))),
                shared[0],
                f"the {max(budget, 0) / GIB:.2f} GiB free on {device} after the "
                f"weights and a {RESERVE:.0%} reserve (set {shared[0]}.kv_cache_memory "
                f"to choose)",
            )
        )
    fits, owner, why = min(limits)
    if rt.kv_cache_tokens is not None:
        want = blocks_for(rt.kv_cache_tokens, rt.kv_block_size)
        if want > fits:
            return fits, owner, f"runtime.kv_cache_tokens {rt.kv_cache_tokens} does not fit: {why}"
        return want, owner, f"runtime.kv_cache_tokens {rt.kv_cache_tokens}"
    if device.type == "cpu":
        limits.append((rt.max_batch_size * per_request, first, "runtime.max_batch_size requests"))
    return min(limits)
