"""Decode / verify attention straight over the slot KV cache (flash-decoding, Triton).

The eager reference is runtime.models.attention.grouped_attention over the views that
KVCache.read returns and ExtendBatch.mask. This kernel differs in what it needs from the
host: nothing. Each row's attended length comes from the device (its query positions), so
a CUDA graph serves every KV length: no attended length padded to a bucket, no mask tensor.

Work split (Tri Dao et al., "Flash-Decoding for long-context inference"): one program per
(row, KV head, KV chunk). It attends the r*T query rows that share the KV head (the r query
heads of the group, stacked as runtime.models.fused.stack_heads does, times T query tokens)
over its chunk of positions with an online softmax, and writes a partial result (running
max m, sum l, unnormalised output). A second kernel combines the chunks. So a single row
spreads over rows x KV heads x chunks programs and fills the GPU; chunks past a row's
length exit at once.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# KV positions per program (a multiple of BLOCK_N). Few rows x KV heads leave most of the GPU
# idle, so they get short chunks: more programs, a shorter serial loop in each (measured on an
# H200, 8b decode at batch 1: 10.8 us a call with 64-position chunks, 13.5 with 256); many rows
# fill the GPU anyway and spend less on the combine with long chunks (batch 16, 5 tokens:
# 31 us with 256, 51 with 64). TANDEM_ATTN_CHUNK fixes one length for A/B runs
# (examples/gpu/kernel_bench.py --chunks).
CHUNK = int(os.environ.get("TANDEM_ATTN_CHUNK", "0"))   # 0: by the number of programs
CHUNK_LONG, CHUNK_SHORT = 256, 64
FEW_PROGRAMS = 64      # rows x KV heads at most for CHUNK_SHORT
BLOCK_N = 32           # KV positions per inner step
MAX_CHUNKS = 64        # chunks per row at most: longer caches get longer chunks


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, valid_ptr,
                    o_ptr, m_ptr, l_ptr,
                    stride_qb, stride_qh, stride_qm,
                    stride_ks, stride_kh, stride_kl,
                    stride_ob, stride_oh, stride_oc, stride_om,
                    T, M, scale, window, chunk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    D: tl.constexpr, T_POW2: tl.constexpr, IEEE: tl.constexpr):
    b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)                       # stacked query rows: head j // T, token j % T
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    t = rows % T
    q_pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1)            # [BLOCK_M]
    q_valid = tl.load(valid_ptr + b * T + t, mask=row_ok, other=0) != 0
    q_pos = tl.where(q_valid, q_pos, -1)               # padding queries attend nothing
    ts = tl.arange(0, T_POW2)
    row_pos = tl.load(pos_ptr + b * T + ts, mask=ts < T, other=-1)
    row_valid = tl.load(valid_ptr + b * T + ts, mask=ts < T, other=0) != 0
    length = tl.max(tl.where(row_valid, row_pos, -1), axis=0) + 1          # row's KV length
    start = c * chunk
    stop = tl.minimum(start + chunk, length)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if start < stop:
        slot = tl.load(slots_ptr + b)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm
                    + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
        kv_base = slot.to(tl.int64) * stride_ks + h * stride_kh
        for n0 in range(start, stop, BLOCK_N):
            kv = n0 + tl.arange(0, BLOCK_N)                                 # [BLOCK_N]
            kv_ok = kv < stop
            offs = kv_base + kv[:, None].to(tl.int64) * stride_kl + dims[None, :]
            ld_mask = kv_ok[:, None] & (dims[None, :] < D)
            k = tl.load(k_ptr + offs, mask=ld_mask, other=0.0)             # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + offs, mask=ld_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale                                                    # [BLOCK_M, BLOCK_N]
            allowed = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            allowed = allowed & ((window <= 0) | (kv[None, :] > q_pos[:, None] - window))
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    base = b * stride_ob + h * stride_oh + c * stride_oc
    tl.store(o_ptr + base + rows[:, None] * stride_om + dims[None, :], acc,
             mask=row_ok[:, None] & (dims[None, :] < D))
    ml = (b * tl.num_programs(1) + h) * tl.num_programs(2) * BLOCK_M + c * BLOCK_M + rows
    tl.store(m_ptr + ml, m_i, mask=row_ok)
    tl.store(l_ptr + ml, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr,
                    stride_ob, stride_oh, stride_oc, stride_om,
                    stride_outb, stride_outt, stride_outh,
                    T, R, n_chunks,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                    D: tl.constexpr):
    b, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)    # j: stacked query row
    cs = tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    c_ok = cs < n_chunks
    ml = (b * tl.num_programs(1) + h) * n_chunks * BLOCK_M + cs * BLOCK_M + j
    m = tl.load(m_ptr + ml, mask=c_ok, other=float("-inf"))                # [BLOCK_C]
    l_part = tl.load(l_ptr + ml, mask=c_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(c_ok & (m > float("-inf")), tl.exp(m - m_safe), 0.0)     # [BLOCK_C]
    l_all = tl.sum(w * l_part, axis=0)
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + cs[:, None] * stride_oc
                + j * stride_om + dims[None, :],
                mask=c_ok[:, None] & (dims[None, :] < D), other=0.0)      # [BLOCK_C, BLOCK_D]
    out = tl.sum(o * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0)
    head, t = h * R + j // T, j % T
    tl.store(out_ptr + b * stride_outb + t * stride_outt + head * stride_outh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < D)


def chunk_len(cache_len: int, programs: int) -> int:
    """KV positions per program for `programs` (rows x KV heads) over a cache of cache_len:
    CHUNK if set, else short chunks for few programs; longer where a cache would need more
    than MAX_CHUNKS chunks."""
    base = CHUNK or (CHUNK_SHORT if programs <= FEW_PROGRAMS else CHUNK_LONG)
    chunk = max(base, -(-cache_len // MAX_CHUNKS))
    return -(-chunk // BLOCK_N) * BLOCK_N


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                   seq: int, window: int | None = None) -> torch.Tensor:
    """Attention of the new tokens over the slot KV cache, their own keys included (written
    before this runs: runtime.models.fused.rotary_write).

    q [B, Hkv, r*T, D] (query heads stacked per KV head, fused.stack_heads); k_cache,
    v_cache [S, Hkv, L, D]; slots [B]; positions [B, T] absolute position of each query;
    valid [B, T] bool (either also as int32: ExtendBatch.int32_rows); seq = T; window:
    sliding window (keys in (pos - window, pos]) or None.
    Returns [B, T, H, D] like grouped_attention; padding queries give zeros."""
    bsz, n_kv, rows, dim = q.shape
    n_rep = rows // seq
    q = q.contiguous()
    chunk = chunk_len(k_cache.shape[2], bsz * n_kv)
    n_chunks = -(-k_cache.shape[2] // chunk)
    block_m = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(dim))
    o_part = torch.empty(bsz, n_kv, n_chunks, block_m, dim, dtype=torch.float32,
                         device=q.device)
    m_part = torch.empty(bsz, n_kv, n_chunks, block_m, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    out = torch.empty(bsz, seq, n_kv * n_rep, dim, dtype=q.dtype, device=q.device)
    pos, ok = (t if t.dtype == torch.int32 and t.is_contiguous()
               else t.to(torch.int32).contiguous() for t in (positions, valid))
    _partial_kernel[(bsz, n_kv, n_chunks)](
        q, k_cache, v_cache, slots, pos, ok, o_part, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        seq, rows, 1.0 / math.sqrt(dim), window or 0, chunk,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, D=dim,
        T_POW2=max(2, triton.next_power_of_2(seq)), IEEE=q.dtype == torch.float32)
    _combine_kernel[(bsz, n_kv, rows)](
        o_part, m_part, l_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        seq, n_rep, n_chunks,
        BLOCK_M=block_m, BLOCK_C=max(2, triton.next_power_of_2(n_chunks)), BLOCK_D=block_d,
        D=dim)
    return out
