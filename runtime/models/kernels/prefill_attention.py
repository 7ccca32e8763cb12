"""Prefill attention straight over the paged KV cache (flash-attention 2 style, Triton).

A long prompt is prefilled in chunks of hundreds to thousands of tokens a row. Each chunk's
queries attend causally within the chunk and fully over the row's cached prefix: a query at
absolute position p sees the KV positions <= p (with a sliding window w only those > p - w).
The chunk's own keys and values are already in the cache (the caller ran rotary_write), so
everything is read from the cache through the row's block table: position p at block
table[b, p // BS], offset p % BS; the BLOCK_N positions of an inner step look their block ids
up in one vector load, as kernels.attention does. An FP8 cache (e4m3 pools, float32 scales
per position and KV head: kernels.fp8_kv) is dequantized the same way: the e4m3 values cast
to q's dtype, K's scales applied to the scores, V's to the probabilities before P @ V.

Work split (kernels.prefill_kernel): one program per (query head, block of BLOCK_M query
tokens, row), each walking its row's KV positions in BLOCK_N steps with an online softmax,
up to its last valid query's position. A padding query (valid 0) and a query block with no
valid query write zeros.

Unlike the decode / verify kernel (kernels.attention.slot_attention), which splits the
cache into chunks over many programs (flash-decoding: few queries, long KV, a second
combine launch), this one gives the parallelism to the queries: a chunk has enough of
them to fill the GPU, so each program walks its whole KV range and normalises its own
output; one launch, no partials. It also stacks nothing per KV head: each program holds
one query head's tokens (their K/V tiles are shared by the group's programs through L2).

Measured on an H200 (lab/gpu/prefill_attention_bench.py: 8b heads, bf16, blocks of 16, one
row, 2k / 8k / 32k prompts in chunks of 512 to 4096, per layer): 117-371 TFLOP/s (causal
FLOPs), 0.98-1.24x the time of torch's flash SDPA (FA2) over K/V gathered beforehand,
1.2-3.2x faster than that SDPA with its KVCache.read gather, 1.7-4.1x than grouped_attention
with the explicit mask. Under the interpreter, bf16 dots take float32 operands (UPCAST).

Eager reference (tests/unit/models/test_prefill_attention.py):
runtime.models.arch.attention.grouped_attention(q, *KVCache.read(batch), batch.mask(window), T).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from runtime.models.kernels.fp8_kv import check_pools, scale_args
from runtime.models.kernels.prefill_kernel import prefill_attention_kernel

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by BLOCK_D on a GPU, measured on an H200 (bf16,
# lab/gpu/prefill_attention_bench.py --configs: one row, 8k / 32k prompts in chunks of 512 to
# 4096, 8b heads H 32 / Hkv 8 for D 128, the same heads for D 64). D 128: 128x128, 8 warps,
# 3 stages reached 318-373 TFLOP/s; 128x64 (the Triton tutorial's) 265-300, 4 stages or 4
# warps less. D 64: 128x64, 4 warps, 3 stages 290-298 at 2k chunks (128x128 / 8 warps 233-253).
# D 256 (H 16 / Hkv 8, 8k prompt): 128x32, 8 warps, 2 stages 204-269 (64x32 / 4 warps 184-256).
# float32 queries (tests; twice the shared memory a tile): float32_config of these.
CONFIGS = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 128, 8, 3),
    256: (128, 32, 8, 2),
}
# A grid of at most one program a multiprocessor (one row's 512-token chunk: 128 programs for
# 32 heads) runs one CTA an SM: D 64's 4 warps then left it latency-bound (151-158 TFLOP/s at
# 32k / 512 against 195-212 with these 8 warps).
FEW_CONFIGS = {64: (128, 128, 8, 3)}
INTERPRET_CONFIG = (16, 16, 4, 1)  # under TRITON_INTERPRET=1: small blocks, fast tests
LOG2E = 1.4426950408889634
_ACT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def block_d(dim: int) -> int:
    """The head_dim's tile: the next power of two, at least 16 (padded columns masked)."""
    return max(16, triton.next_power_of_2(dim))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def config(dim: int, device: torch.device, programs: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head_dim on a grid of `programs`
    (B x H x query blocks of CONFIGS' BLOCK_M): CONFIGS on a GPU, FEW_CONFIGS where the grid
    has at most one program a multiprocessor, INTERPRET_CONFIG on the CPU."""
    if device.type != "cuda":
        return INTERPRET_CONFIG
    tile = block_d(dim)
    if tile in FEW_CONFIGS and 0 < programs <= _multiprocessors(device):
        return FEW_CONFIGS[tile]
    return CONFIGS[tile]


def float32_config(cfg: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """A bf16 config's tiles for float32 operands within the shared memory (not tuned)."""
    return min(cfg[0], 64), max(16, cfg[1] // 2), 4, min(cfg[3], 2)


def programs(q: torch.Tensor, seq: int) -> int:
    """The grid's size with CONFIGS' BLOCK_M: rows x query heads x query blocks."""
    bsz, n_kv, rows, dim = q.shape
    return bsz * n_kv * (rows // seq) * triton.cdiv(seq, CONFIGS[block_d(dim)][0])


def fits(q: torch.Tensor, k_cache: torch.Tensor, kv_scales: tuple = ()) -> bool:
    """Whether prefill_attention takes these: q [B, Hkv, r*T, D] float32 / float16 / bfloat16
    with D <= 256 (any D: the tile is padded to a power of two, BLOCK_D); k_cache
    [N+1, Hkv, BS, D] in q's dtype, or e4m3 with kv_scales; the same device."""
    if q.dim() != 4 or k_cache.dim() != 4 or q.dtype not in _ACT:
        return False
    dim = q.shape[3]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    return (
        0 < dim <= 256
        and k_cache.shape[3] == dim
        and k_cache.shape[1] == q.shape[1]
        and (k_cache.dtype == q.dtype or fp8)
        and fp8 == bool(kv_scales)
        and q.device == k_cache.device
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    window: int | None = None,
    kv_scales: tuple[torch.Tensor, ...] = (),
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A prefill chunk's attention over the paged cache -> [B, T, H, D] in q's dtype.

    q [B, Hkv, r*T, D]: the chunk's rotated queries, the r query heads of each KV head
    stacked (row j: head kv_head * r + j // T, token j % T; fused.stack_heads, what
    rotary_write returns), their keys and values already in the caches. k_cache, v_cache
    [N+1, Hkv, BS, D]; block_table [B, M] int32 (position p of row b at block
    block_table[b, p // BS], offset p % BS); positions, valid [B, T] (int32:
    ExtendBatch.int32_rows; others are converted): each query's absolute position and
    whether it is real; window: keys in (p - window, p], or None; kv_scales: an FP8 cache's
    (k_scale, v_scale) [N+1, Hkv, BS] float32 (KVCache.scales), or (). scale: of q.k (default
    D ** -0.5); softcap c: the scaled scores become c * tanh(s / c) before the mask (Gemma 2).
    Padding queries give zeros. `fits` says which shapes it takes."""
    _check(q, k_cache, v_cache, kv_scales)
    bsz, n_kv, rows, dim = q.shape
    seq = positions.shape[1]
    n_rep = rows // seq
    q = q.contiguous()
    pos, ok = (
        x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()
        for x in (positions, valid)
    )
    table = block_table.to(torch.int32).contiguous()  # no copy for ExtendBatch's
    out = torch.empty(bsz, seq, n_kv * n_rep, dim, dtype=q.dtype, device=q.device)
    _launch(q, k_cache, v_cache, table, pos, ok, out, window, kv_scales, scale, softcap)
    return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple) -> None:
    """Raise unless prefill_attention takes these (`fits`, pools that agree)."""
    if not fits(q, k_cache, kv_scales):
        raise ValueError(
            f"prefill_attention: q {tuple(q.shape)} {q.dtype} over a "
            f"{tuple(k_cache.shape)} {k_cache.dtype} pool, {len(kv_scales)} scales"
        )
    check_pools(k_cache, kv_scales)
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("prefill_attention: the K and V pools must share shape and strides")


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor,
    ok: torch.Tensor,
    out: torch.Tensor,
    window: int | None,
    kv_scales: tuple,
    scale: float | None,
    softcap: float | None,
) -> None:
    """prefill_attention_kernel over grid (H, query blocks, B) into out [B, T, H, D]: q
    contiguous, pos / ok [B, T] and table int32 (prefill_attention's)."""
    bsz, n_kv, rows, dim = q.shape
    seq = pos.shape[1]
    n_rep = rows // seq
    block_m, block_n, warps, stages = config(dim, q.device, programs(q, seq))
    if q.dtype == torch.float32 and q.device.type == "cuda":
        block_m, block_n, warps, stages = float32_config((block_m, block_n, warps, stages))
    upcast = q.dtype == torch.bfloat16 and q.device.type != "cuda"  # the interpreter
    grid = (n_kv * n_rep, triton.cdiv(seq, block_m), bsz)
    prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        table,
        pos,
        ok,
        out,
        *scale_args(kv_scales, k_cache),
        *q.stride()[:3],
        table.stride(0),
        *k_cache.stride()[:3],
        *out.stride()[:3],
        seq,
        n_rep,
        LOG2E * (dim**-0.5 if scale is None else scale),
        window or 0,
        LOG2E * (softcap or 1.0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d(dim),
        D=dim,
        BS=k_cache.shape[2],
        IEEE=q.dtype == torch.float32 or upcast,
        ACT=_ACT[q.dtype],
        KV8=bool(kv_scales),
        UPCAST=upcast,
        SOFTCAP=softcap is not None,
        num_warps=warps,
        num_stages=stages,
    )
