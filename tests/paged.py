"""Block pools and tables for the kernel and attention tests (runtime.models.arch.cache)."""

from __future__ import annotations

import torch

from runtime.models.arch.cache import ExtendBatch, KVCache, blocks_for, slot_block_table


def pool(
    rows: int,
    cache_len: int,
    n_kv: int,
    dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    random: bool = True,
) -> tuple[KVCache, torch.Tensor]:
    """A pool for `rows` rows of cache_len positions (random K and V, scratch included) and
    the rows' fixed tables [rows, M] int32 (slot s: blocks s*M .. s*M + M - 1)."""
    m = blocks_for(cache_len, block_size)
    cache = KVCache(rows * m, block_size, n_kv, dim, dtype)
    if random:
        cache.k_cache.normal_()
        cache.v_cache.normal_()
    return cache, torch.tensor(slot_block_table(range(rows), m), dtype=torch.int32)


def shuffled(cache: KVCache, table: torch.Tensor, seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    """The same K and V with the blocks stored in a random order, and the tables that address
    them: block i of `cache` is block perm[i] of the copy (rows' blocks interleave)."""
    n = cache.num_blocks
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    copy = KVCache(
        n, cache.block_size, cache.k_cache.shape[1], cache.k_cache.shape[3], cache.k_cache.dtype
    )
    for src, dst in ((cache.k_cache, copy.k_cache), (cache.v_cache, copy.v_cache)):
        dst[perm] = src[:n]
        dst[n] = src[n]
    return copy, perm[table.long()].to(torch.int32)


def batch(
    cache: KVCache, tables: torch.Tensor, starts, n_valid, seq: int, kv_len: int | None = None
) -> ExtendBatch:
    """ExtendBatch of rows with these tables [B, M], starts and valid lengths (lists)."""
    kv_len = kv_len or max(s + n for s, n in zip(starts, n_valid))
    return ExtendBatch.build(
        tables.contiguous(),
        torch.tensor(starts),
        torch.tensor(n_valid),
        seq,
        kv_len,
        cache.block_size,
        cache.scratch,
    )
