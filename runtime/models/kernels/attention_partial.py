"""The first launch of the decode / verify attention (kernels.attention.slot_attention), in
Triton: one program per (row, KV head, KV chunk) attends the r*T stacked query rows that
share the KV head over its chunk of the paged cache with an online softmax and writes a
partial result (running max m, sum l, unnormalised output), which kernels.combine combines.
A chunk at or past its row's length (found on the device) returns before storing anything.
ROPE: the program rotates its queries and writes the row's new keys and values itself
(kernels.rope_rows) instead of the separate RoPE kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.models.kernels.combine import row_length
from runtime.models.kernels.rope_rows import new_rows, write_new_kv
from runtime.models.kernels.softcap import soft_cap


@triton.jit
def partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    pos_ptr,
    valid_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_tb,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_ob,
    stride_oh,
    stride_oc,
    stride_om,
    T,
    M,
    scale,
    window,
    chunk,
    softcap,
    nq_ptr,
    nk_ptr,
    nv_ptr,
    cos_ptr,
    sin_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    stride_nqt,
    stride_nqh,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_ct,
    stride_xs,
    R,
    KV_COL,
    V_COL,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_sh,
    stride_sl,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    T_POW2: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
    ROPE: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    KV8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """SOFTCAP: scaled scores capped at softcap * tanh(s / softcap) (Gemma 2).
    KV8: e4m3 pools with per-position scales (ks_ptr, vs_ptr: kernels.fp8_kv), cast to
    ACT and scaled in float32: K's scales multiply the scores, V's the probabilities.
    ROPE: q_ptr is unused; the program rotates its queries itself from the step's q
    (nq_ptr: rope.NewTokens, raw FP8 output with RAW) and first writes the rotated keys and
    the values of the row's new tokens whose positions fall in its chunk (nk_ptr, nv_ptr) to
    the caches, which it then reads like any other position (after a barrier: the program's
    own stores). Every new position lies in exactly one live chunk, so each is written once."""
    b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = c * chunk
    length = row_length(pos_ptr, valid_ptr, b, T, T_POW2)  # row's KV length
    if start >= length:
        return  # a dead chunk: stores nothing, the combine skips it
    stop = tl.minimum(start + chunk, length)
    table_row = table_ptr + b * stride_tb  # the row's block table
    head_base = h.to(tl.int64) * stride_kh
    # the first step's block ids, loaded before anything else, and each next step's a step
    # ahead (in the loop): the K/V loads depend on them. Measured on an H200 (bf16, 8b heads,
    # slot cache of main vs this, same bits): batch 1 decode 1.02-1.03x main's time, 5-token
    # verify 1.04-1.05x, batch 16/64 0.93-1.05x; loading the ids in the step itself instead
    # cost 1.05-1.13x (decode) and up to 1.42x (verify).
    first = start + tl.arange(0, BLOCK_N)
    blk_next = tl.load(table_row + first // BS, mask=first < stop, other=0)
    rows = tl.arange(0, BLOCK_M)  # stacked query rows: head j // T, token j % T
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    t = rows % T
    q_pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1)  # [BLOCK_M]
    q_valid = tl.load(valid_ptr + b * T + t, mask=row_ok, other=0) != 0
    q_pos = tl.where(q_valid, q_pos, -1)  # padding queries attend nothing
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if ROPE:
        # the rows' query heads h * R + j // T (token t), rotated and rounded as
        # rope_kernel.rope_write_kernel stores them
        tok = b * T + t
        head = h * R + rows // T
        q = new_rows(
            nq_ptr + tok[:, None] * stride_nqt + head[:, None] * stride_nqh,
            head[:, None] * D,
            tok,
            row_ok,
            dims,
            cos_ptr,
            sin_ptr,
            xs_ptr,
            ws_ptr,
            bias_ptr,
            stride_ct,
            stride_xs,
            True,
            D,
            RAW,
            HAS_BIAS,
            ACT,
        ).to(ACT)
        write_new_kv(
            nk_ptr,
            nv_ptr,
            cos_ptr,
            sin_ptr,
            xs_ptr,
            ws_ptr,
            bias_ptr,
            k_ptr,
            v_ptr,
            pos_ptr,
            valid_ptr,
            table_row,
            head_base,
            b,
            h,
            T,
            start,
            stop,
            stride_nkt,
            stride_nkh,
            stride_nvt,
            stride_nvh,
            stride_ct,
            stride_xs,
            stride_kb,
            stride_kl,
            KV_COL,
            V_COL,
            ks_ptr,
            vs_ptr,
            h * stride_sh,
            stride_sb,
            stride_sl,
            BLOCK_D,
            D,
            T_POW2,
            BS,
            RAW,
            HAS_BIAS,
            ACT,
            KV8,
        )
        tl.debug_barrier()  # this program's cache stores before its loads
    else:
        q = tl.load(
            q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :],
            mask=row_ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )
    for n0 in range(start, stop, BLOCK_N):
        kv = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        kv_ok = kv < stop
        blk = blk_next.to(tl.int64)  # [BLOCK_N]
        ahead = kv + BLOCK_N  # the next step's ids, a step ahead (hides their latency)
        blk_next = tl.load(table_row + ahead // BS, mask=ahead < stop, other=0)
        offs = (
            head_base
            + blk[:, None] * stride_kb
            + (kv % BS)[:, None].to(tl.int64) * stride_kl
            + dims[None, :]
        )
        ld_mask = kv_ok[:, None] & (dims[None, :] < D)
        k = tl.load(k_ptr + offs, mask=ld_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + offs, mask=ld_mask, other=0.0)
        if KV8:  # exact casts; the scales [BLOCK_N] applied below
            s_offs = h * stride_sh + blk * stride_sb + (kv % BS).to(tl.int64) * stride_sl
            k_sc = tl.load(ks_ptr + s_offs, mask=kv_ok, other=0.0)
            v_sc = tl.load(vs_ptr + s_offs, mask=kv_ok, other=0.0)
            k, v = k.to(ACT), v.to(ACT)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KV8:
            s = s * k_sc[None, :]
        s = s * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = soft_cap(s, softcap)
        allowed = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        allowed = allowed & ((window <= 0) | (kv[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV8:
            p = p * v_sc[None, :]  # (P * v_scale) @ e4m3(V): P @ dequantized V
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    base = b * stride_ob + h * stride_oh + c * stride_oc
    tl.store(
        o_ptr + base + rows[:, None] * stride_om + dims[None, :],
        acc,
        mask=row_ok[:, None] & (dims[None, :] < D),
    )
    ml = (b * tl.num_programs(1) + h) * tl.num_programs(2) * BLOCK_M + c * BLOCK_M + rows
    tl.store(m_ptr + ml, m_i, mask=row_ok)
    tl.store(l_ptr + ml, l_i, mask=row_ok)
