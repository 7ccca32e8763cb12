"""The KV cache's memory budget: each model's block pool is preallocated once, at startup,
for max_batch_size rows of max_seq_len (+ draft room) positions (rounded up to whole blocks
of runtime.kv_block_size), and must fit its budget.

Budget: `<model>.kv_cache_memory` (a share of the device's total memory) when set, so that a
draft and a target sharing a GPU can each be given their part; otherwise what the device has
free after the weights (measured once they are loaded, so FP8 weights count at their real
size: 1 byte a value plus their float32 scales), less a reserve for activations and CUDA
graphs. A cache that does not fit is a clear startup error naming the key, never an
out-of-memory in the middle of a request.
"""

from __future__ import annotations

import os

import torch

from runtime.models.arch.base import CausalLM, is_paged
from runtime.models.arch.cache import KVCache, blocks_for
from runtime.models.arch.decoder_layer import DecoderLayer

GIB = 1024**3
RESERVE = 0.05  # of total device memory, kept free for activations when no budget is set


def _attention_layers(model: CausalLM) -> list[DecoderLayer] | None:
    """The decoder layers of a PagedModel, or None for a model that allocates its own
    cache (transformers fallback)."""
    if not is_paged(model):
        return None
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


def block_bytes(model: CausalLM, block_size: int, kv_dtype: str = "auto") -> int | None:
    """Bytes ONE block of block_size positions costs across every layer of this (possibly
    TP-sharded: local heads) model: K and V in the activation dtype (the norms'; FP8
    weights are 1 byte), or with kv_dtype "fp8" e4m3 plus a float32 scale per position and
    KV head for each (KVCache.position_bytes); None for a model without our layers."""
    layers = _attention_layers(model)
    if layers is None:
        return None
    return sum(
        block_size
        * KVCache.position_bytes(
            layer.self_attn.n_kv_heads,
            layer.self_attn.head_dim,
            layer.post_attention_layernorm.weight.dtype,
            kv_dtype,
        )
        for layer in layers
    )


def cache_bytes(
    model: CausalLM,
    num_slots: int,
    cache_len: int,
    block_size: int = 16,
    kv_dtype: str = "auto",
) -> int | None:
    """Bytes of K and V (and an FP8 cache's scales) for every layer of this (possibly
    TP-sharded) model: num_slots x ceil(cache_len / block_size) blocks and the scratch
    block (LlamaForCausalLM.allocate_cache); None when the model allocates its own cache
    (transformers fallback)."""
    per_block = block_bytes(model, block_size, kv_dtype)
    if per_block is None:
        return None
    return (num_slots * blocks_for(cache_len, block_size) + 1) * per_block


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device; physical memory for CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def check_kv_budget(
    key: str,
    model: CausalLM,
    num_slots: int,
    cache_len: int,
    fraction: float | None,
    device: torch.device,
    block_size: int = 16,
    kv_dtype: str = "auto",
) -> None:
    """Raise MemoryError naming `key` when the cache does not fit its budget."""
    need = cache_bytes(model, num_slots, cache_len, block_size, kv_dtype)
    if need is None:
        return
    free, total = device_memory(device)
    if fraction is not None:
        budget, what = (
            fraction * total,
            f"{key}.kv_cache_memory {fraction} of {total / GIB:.1f} GiB",
        )
    else:
        budget = free - RESERVE * total
        what = (
            f"the {free / GIB:.1f} GiB free on {device} less a {RESERVE:.0%} reserve "
            f"(set {key}.kv_cache_memory to choose)"
        )
    if need > budget:
        raise MemoryError(
            f"{key} KV cache needs {need / GIB:.2f} GiB ({num_slots} slots x {cache_len} "
            f"positions) but the budget is {max(budget, 0) / GIB:.2f} GiB: {what}; lower "
            f"runtime.max_batch_size or runtime.max_seq_len"
        )
