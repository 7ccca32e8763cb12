"""Decode / verify attention straight over the slot KV cache (flash-decoding, Triton).

The eager reference is runtime.models.attention.grouped_attention over the views that
KVCache.read returns and ExtendBatch.mask. This kernel differs in what it needs from the
host: nothing. Each row's attended length comes from the device (its query positions), so
a CUDA graph serves every KV length: no attended length padded to a bucket, no mask tensor.

Work split (Tri Dao et al., "Flash-Decoding for long-context inference"): one program per
(row, KV head, KV chunk). It attends the r*T query rows that share the KV head (the r query
heads of the group, stacked as runtime.models.fused.stack_heads does, times T query tokens)
over its chunk of positions with an online softmax, and writes a partial result (running
max m, sum l, unnormalised output). So a single row spreads over rows x KV heads x chunks
programs and fills the GPU; chunks past a row's length skip the loop. The chunks are combined
in the same kernel: each program counts itself done on a per-(row, KV head) counter, and the
last one to finish merges the partial results in chunk order (deterministic) and resets the
counter for the next call: one launch per layer, not two.
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
def _attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, valid_ptr,
                      o_ptr, m_ptr, l_ptr, count_ptr, out_ptr,
                      stride_qb, stride_qh, stride_qm,
                      stride_ks, stride_kh, stride_kl,
                      stride_ob, stride_oh, stride_oc, stride_om,
                      stride_outb, stride_outt, stride_outh,
                      T, R, M, scale, window, chunk,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      D: tl.constexpr, T_POW2: tl.constexpr, IEEE: tl.constexpr,
                      COMBINE: tl.constexpr):
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
    o_mask = row_ok[:, None] & (dims[None, :] < D)
    o_offs = b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :]
    n_chunks = tl.num_programs(2)
    ml = (b * tl.num_programs(1) + h) * n_chunks * BLOCK_M + rows
    if start < stop:   # chunks past the row's length are never read
        tl.store(o_ptr + o_offs + c * stride_oc, acc, mask=o_mask)
        tl.store(m_ptr + ml + c * BLOCK_M, m_i, mask=row_ok)
        tl.store(l_ptr + ml + c * BLOCK_M, l_i, mask=row_ok)
    counter = count_ptr + b * tl.num_programs(1) + h
    if tl.atomic_add(counter, 1) == n_chunks - 1:    # the last chunk done: combine them all
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        o_all = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        cs = tl.arange(0, COMBINE)
        for c0 in range(0, tl.cdiv(length, chunk), COMBINE):   # chunks with positions, in order
            ok = (c0 + cs)[:, None] < tl.cdiv(length, chunk)          # [C, 1]
            at = ml[None, :] + (c0 + cs)[:, None] * BLOCK_M           # [C, BM]
            m_c = tl.load(m_ptr + at, mask=ok & row_ok[None, :], other=float("-inf"),
                          cache_modifier=".cg")
            l_c = tl.load(l_ptr + at, mask=ok & row_ok[None, :], other=0.0, cache_modifier=".cg")
            o_c = tl.load(o_ptr + o_offs[None, :, :] + (c0 + cs)[:, None, None] * stride_oc,
                          mask=ok[:, :, None] & o_mask[None, :, :], other=0.0,
                          cache_modifier=".cg")                        # [C, BM, BD]
            m_new = tl.maximum(m_all, tl.max(m_c, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w_c = tl.exp(m_c - m_safe[None, :])                        # [C, BM]
            w_old = tl.exp(m_all - m_safe)
            l_all = l_all * w_old + tl.sum(w_c * l_c, axis=0)
            o_all = o_all * w_old[:, None] + tl.sum(w_c[:, :, None] * o_c, axis=0)
            m_all = m_new
        tl.atomic_xchg(counter, 0)
        o_all = o_all / tl.where(l_all > 0, l_all, 1.0)[:, None]
        head, t = h * R + rows // T, rows % T                            # stacked row -> (head, token)
        tl.store(out_ptr + b * stride_outb + t[:, None] * stride_outt
                 + head[:, None] * stride_outh + dims[None, :],
                 o_all.to(out_ptr.dtype.element_ty), mask=o_mask)


def chunk_len(cache_len: int, programs: int) -> int:
    """KV positions per program for `programs` (rows x KV heads) over a cache of cache_len:
    CHUNK if set, else short chunks for few programs; longer where a cache would need more
    than MAX_CHUNKS chunks."""
    base = CHUNK or (CHUNK_SHORT if programs <= FEW_PROGRAMS else CHUNK_LONG)
    chunk = max(base, -(-cache_len // MAX_CHUNKS))
    return -(-chunk // BLOCK_N) * BLOCK_N


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                   seq: int, window: int | None = None,
                   counters: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new tokens over the slot KV cache, their own keys included (written
    before this runs: runtime.models.fused.rotary_write).

    q [B, Hkv, r*T, D] (query heads stacked per KV head, fused.stack_heads); k_cache,
    v_cache [S, Hkv, L, D]; slots [B]; positions [B, T] absolute position of each query;
    valid [B, T] bool (either also as int32: ExtendBatch.int32_rows); seq = T; window:
    sliding window (keys in (pos - window, pos]) or None; counters: at least B * Hkv int32
    zeros, left zero by every call (KVCache.counters: one set per layer, so that two models
    on two streams never share them; None: made for this call).
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
    if counters is None:
        counters = torch.zeros(bsz * n_kv, dtype=torch.int32, device=q.device)
    elif counters.numel() < bsz * n_kv or counters.dtype != torch.int32:
        raise ValueError(f"slot_attention: {bsz * n_kv} int32 counters needed, "
                         f"got {counters.numel()} {counters.dtype}")
    _attention_kernel[(bsz, n_kv, n_chunks)](
        q, k_cache, v_cache, slots, pos, ok, o_part, m_part, l_part, counters, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        seq, n_rep, rows, 1.0 / math.sqrt(dim), window or 0, chunk,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, D=dim,
        T_POW2=max(2, triton.next_power_of_2(seq)), IEEE=q.dtype == torch.float32,
        COMBINE=max(1, min(4, 64 // block_m)))
    return out
