"""Decode / verify attention straight over the paged KV cache (flash-decoding, Triton).

The eager reference is runtime.models.arch.attention.grouped_attention over the rows that
KVCache.read gathers and ExtendBatch.mask. Keys and values are read through each row's
block table (runtime.models.arch.cache): position p at block table[b, p // BS], offset
p % BS; the BLOCK_N positions of an inner step look their block ids up in one vector load. This
kernel differs in what it needs from the
host: nothing. Each row's attended length comes from the device (its query positions), so
a CUDA graph serves every KV length: no attended length padded to a bucket, no mask tensor.

Work split (Tri Dao et al., "Flash-Decoding for long-context inference"): one program per
(row, KV head, KV chunk) of the whole cache. It attends the r*T query rows that share the KV
head (the r query heads of the group, stacked as runtime.models.arch.fused.stack_heads does,
times T query tokens) over its chunk of positions with an online softmax, and writes a
partial result (running max m, sum l, unnormalised output): kernels.attention_partial. A
second kernel combines the chunks (kernels.combine). So a single row spreads over rows x KV
heads x chunks programs and fills the GPU.
A chunk at or past its row's length is dead: its program returns before storing anything,
and the combine, which finds the same length on the device, reads only the live chunks
(masked loads: a long cache under a short context costs no partial traffic).

FP8 variant (quantize=True): the combine also quantizes the output per token for the FP8
o_proj, in the same launch: runtime.models.arch.fused.fp8_quantize_rows of the [B*T, H*D]
output rounded to q's dtype, i.e. fused.fp8_quantize_heads of the plain output (see
slot_attention for how exact).
"""

from __future__ import annotations

import math

import torch
import triton

from runtime.models.kernels.attention_partial import partial_kernel
from runtime.models.kernels.combine import _ROUND, combine, combine_fp8
from runtime.models.kernels.fp8_kv import check_pools, scale_args
from runtime.models.kernels.rope import NewTokens

# KV positions per program (a multiple of BLOCK_N). Few rows x KV heads leave most of the GPU
# idle, so they get short chunks: more programs, a shorter serial loop in each (measured on an
# H200, 8b decode at batch 1: 10.8 us a call with 64-position chunks, 13.5 with 256); many rows
# fill the GPU anyway and spend less on the combine with long chunks (batch 16, 5 tokens:
# 31 us with 256, 51 with 64). CHUNK fixes one length (tests, lab/gpu/kernel_bench.py --chunks).
CHUNK = 0  # 0: by the number of programs
CHUNK_LONG, CHUNK_SHORT = 256, 64
FEW_PROGRAMS = 64  # rows x KV heads at most for CHUNK_SHORT
BLOCK_N = 32  # KV positions per inner step
MAX_CHUNKS = 64  # chunks per row at most: longer caches get longer chunks
# RoPE and the new tokens' KV write inside the partial kernel (slot_attention of NewTokens)
# instead of the separate rope kernel, for steps of at least FOLD_ROPE_MIN_SEQ tokens a row:
# measured on an H200 (lab/h200_lab.sh fold-ab, 8b, GPU time a step), a 5-token
# verify step runs 1.009-1.019x faster folded (bf16 / FP8, batch 1 / 16), a 1-token decode
# step 0.990-0.999x (probably: every chunk's program rotates the queries before its first
# KV load), so decode keeps the separate kernel.
FOLD_ROPE_MIN_SEQ = 2


def chunk_len(cache_len: int, programs: int) -> int:
    """KV positions per program for `programs` (rows x KV heads) over a cache of cache_len:
    CHUNK if set, else short chunks for few programs; longer where a cache would need more
    than MAX_CHUNKS chunks."""
    base = CHUNK or (CHUNK_SHORT if programs <= FEW_PROGRAMS else CHUNK_LONG)
    chunk = max(base, -(-cache_len // MAX_CHUNKS))
    return -(-chunk // BLOCK_N) * BLOCK_N


def chunks(cache_len: int, programs: int) -> tuple[int, int]:
    """(chunk_len, the number of chunks over the whole cache)."""
    chunk = chunk_len(cache_len, programs)
    return chunk, -(-cache_len // chunk)


def _partials(
    q: torch.Tensor | NewTokens,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor,
    ok: torch.Tensor,
    seq: int,
    window: int | None,
    chunk: int,
    n_chunks: int,
    kv_scales: tuple = (),
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """partial_kernel over grid (B, Hkv, chunks of the cache) -> (o [B, Hkv, C, BLOCK_M, D],
    m and l [B, Hkv, C, BLOCK_M]) float32, written for the live chunks only. q: the stacked
    queries, or the step's NewTokens (the kernel rotates them and writes the new KV);
    kv_scales: an FP8 cache's (k_scale, v_scale) [N+1, Hkv, BS], or ()."""
    bsz, n_kv, rows, dim = _query_shape(q)
    block_m = max(16, triton.next_power_of_2(rows))
    device = k_cache.device
    o_part = torch.empty(bsz, n_kv, n_chunks, block_m, dim, dtype=torch.float32, device=device)
    m_part = torch.empty(bsz, n_kv, n_chunks, block_m, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    new, stacked = _kernel_queries(q, k_cache)
    rope = isinstance(q, NewTokens)
    meta = _partial_meta(new, rope, block_m, dim, seq, k_cache, kv_scales, softcap)
    partial_kernel[(bsz, n_kv, n_chunks)](
        stacked[0],
        k_cache,
        v_cache,
        table,
        pos,
        ok,
        o_part,
        m_part,
        l_part,
        *stacked[1:],
        table.stride(0),
        *k_cache.stride()[:3],
        *o_part.stride()[:4],
        seq,
        rows,
        1.0 / math.sqrt(dim) if scale is None else scale,
        window or 0,
        chunk,
        softcap or 1.0,
        *new.pointers(),
        *new.strides(),
        *new.columns(),
        *scale_args(kv_scales, k_cache),
        **meta,
    )
    return o_part, m_part, l_part


def _kernel_queries(q: torch.Tensor | NewTokens, k_cache: torch.Tensor) -> tuple[NewTokens, tuple]:
    """(NewTokens, (stacked q, its three strides)) as partial_kernel takes q: the step's
    NewTokens with placeholders for the stacked q (ROPE), or the stacked q with placeholder
    NewTokens."""
    if isinstance(q, NewTokens):
        return q, (k_cache, 0, 0, 0)  # no stacked q: placeholders
    return _placeholder_tokens(q), (q, q.stride(0), q.stride(1), q.stride(2))


def _partial_meta(
    new: NewTokens,
    rope: bool,
    block_m: int,
    dim: int,
    seq: int,
    k_cache: torch.Tensor,
    kv_scales: tuple,
    softcap: float | None,
) -> dict:
    """partial_kernel's compile-time arguments for the step's NewTokens (or their
    placeholders: rope False) in the activation dtype new.dtype."""
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        D=dim,
        T_POW2=max(2, triton.next_power_of_2(seq)),
        BS=k_cache.shape[2],
        IEEE=new.dtype == torch.float32,
        ROPE=rope,
        RAW=new.raw,
        HAS_BIAS=new.has_bias,
        ACT=_ROUND[new.dtype],
        KV8=bool(kv_scales),
        SOFTCAP=softcap is not None,
    )


def _query_shape(q: torch.Tensor | NewTokens) -> tuple[int, int, int, int]:
    """(B, Hkv, r*T, D) of the stacked queries either form stands for."""
    if isinstance(q, NewTokens):
        tokens, n_heads, dim = q.q.shape
        return tokens // q.seq, q.k.shape[1], n_heads // q.k.shape[1] * q.seq, dim
    bsz, n_kv, rows, dim = q.shape
    return bsz, n_kv, rows, dim


def _placeholder_tokens(q: torch.Tensor) -> NewTokens:
    """NewTokens the kernel does not read (ROPE off): q's own pointer, one head per KV head."""
    flat = q[:, :, 0]  # [B, Hkv, D]
    return NewTokens(flat, flat, flat, flat[:, 0], flat[:, 0], q.dtype, 1)


def fits_head_dim(dim: int) -> bool:
    """Whether slot_attention takes a step's NewTokens of this head_dim (rotating and writing
    them itself): a power of two, at least 16 (one block of it)."""
    return dim >= 16 and dim & (dim - 1) == 0


def slot_attention(
    q: torch.Tensor | NewTokens,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    seq: int,
    window: int | None = None,
    *,
    quantize: bool = False,
    kv_scales: tuple[torch.Tensor, ...] = (),
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of the new tokens over the paged KV cache, their own keys included.

    q [B, Hkv, r*T, D] (query heads stacked per KV head, fused.stack_heads), rotated and with
    the new keys and values already in the caches (runtime.models.arch.fused.rotary_write); or
    the step's q, k, v before RoPE (rope.NewTokens, `fits_head_dim`): then the partial kernel
    rotates them and writes the new keys and values itself, one launch fewer, the same
    arithmetic (a row's valid tokens must be its newest positions, as ExtendBatch builds
    them; padding tokens are not written at all). k_cache, v_cache [N+1, Hkv, BS, D] (block
    pools); block_table [B, M] int32 (contiguous rows: position p of row b at block
    block_table[b, p // BS], offset p % BS); positions [B, T] absolute position of each query;
    valid [B, T] bool (either also as int32: ExtendBatch.int32_rows); seq = T; window:
    sliding window (keys in (pos - window, pos]) or None; kv_scales: KVCache.scales, an FP8
    cache's (k_scale, v_scale) [N+1, Hkv, BS] float32 with e4m3 pools (read and written
    quantized: kernels.fp8_kv), () for pools in the activation dtype; scale: of q.k (default
    D ** -0.5); softcap c: scaled scores capped at c * tanh(s / c) before the mask (Gemma 2).
    Returns [B, T, H, D] like grouped_attention; padding queries give zeros.
    quantize=True: o_proj's FP8 input instead, fused.fp8_quantize_heads of that output:
    ([B*T, H*D] e4m3, [B*T, 1] float32 scales), padding tokens zeros with scale 1e-12 / 448.
    Bit for bit under the Triton interpreter. On a GPU the two combines add the chunks in
    different orders (a tree; c = 0, 1, ...), so a float32 sum can differ in its last bit
    (an H200, bf16/fp16/float32: 13 of 19M e4m3 values one step apart; float32 q: scales
    within 3e-7). Speed: see combine.combine_fp8."""
    bsz, n_kv, rows, dim = _query_shape(q)
    n_rep = rows // seq
    if not isinstance(q, NewTokens):
        q = q.contiguous()
    elif not fits_head_dim(dim):
        raise ValueError(
            f"slot_attention: head_dim {dim} must be a power of two >= 16 for "
            "the step's q/k/v before RoPE"
        )
    check_pools(k_cache, kv_scales)
    dtype = q.dtype
    pos, ok = (
        t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
        for t in (positions, valid)
    )
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    chunk, n_chunks = chunks(capacity(table, k_cache), bsz * n_kv)
    parts = _partials(
        q, k_cache, v_cache, table, pos, ok, seq, window, chunk, n_chunks, kv_scales, scale, softcap
    )
    o_part = parts[0]
    block_m = o_part.shape[3]
    meta = dict(
        BLOCK_M=block_m,
        BLOCK_C=max(2, triton.next_power_of_2(n_chunks)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        D=dim,
        T_POW2=max(2, triton.next_power_of_2(seq)),
    )
    strides = [o_part.stride(i) for i in range(4)]
    if quantize:
        return combine_fp8(parts, pos, ok, strides, seq, n_rep, chunk, dtype, meta)
    return combine(parts, pos, ok, strides, seq, n_rep, chunk, dtype, meta)


FUSED_FP8_CHUNKS = 8  # quantize in the combine while a row has at most this many chunks
FUSED_FP8_TOKENS = 16  # or the step this many tokens


def capacity(block_table: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Positions a row's block table addresses: its width x the block size."""
    return block_table.shape[1] * k_cache.shape[2]


def fp8_combine_pays(q: torch.Tensor | NewTokens, cache_len: int, seq: int) -> bool:
    """Whether slot_attention(..., quantize=True) beats the plain call + a quantize kernel for
    q [B, Hkv, r*T, D] over rows of cache_len positions (`capacity`; host-side: the
    allocated chunks, not the live ones). Its
    one program per token reads all the token's partials (see combine.combine_fp8): it pays for a
    short cache or many tokens."""
    bsz, n_kv = _query_shape(q)[:2]
    n_chunks = chunks(cache_len, bsz * n_kv)[1]
    return n_chunks <= FUSED_FP8_CHUNKS or bsz * seq >= FUSED_FP8_TOKENS
