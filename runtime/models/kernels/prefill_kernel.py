"""The prefill flash-attention Triton kernel that kernels.prefill_attention launches.

One program per (query head, block of BLOCK_M query tokens, row): grid (H, cdiv(T, BLOCK_M),
B), the query blocks launched last-first (the heaviest causal work first, so the tail of the
launch is short ones). A program loads its BLOCK_M queries once and walks the KV positions
of its row in BLOCK_N steps with an online softmax (float32 running max, sum and
accumulator), up to its last valid query's position. The walk has three parts: masked steps
at the sliding window's lower edge (windowed layers only), then steps that every valid query
of the block sees whole (no mask, no bounds: the long cached prefix), then masked steps
along the diagonal (causal, and the row's length). A padding query (valid 0) and a query
block with no valid query write zeros. Scores are in log2 units (exp2): the launcher passes
qk_scale and softcap times LOG2E.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.models.kernels.softcap import soft_cap


@triton.jit
def _step(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_row,
    head_base,
    s_head,
    n0,
    hi,
    q_pos,
    window,
    qk_scale,
    softcap,
    dims,
    stride_kb,
    stride_kl,
    stride_sb,
    stride_sl,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
    ACT: tl.constexpr,
    KV8: tl.constexpr,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One BLOCK_N step of the online softmax over KV positions n0 ..; MASKED: causal,
    window and the row's length (hi) applied, else every position is seen by every row.
    UPCAST: bf16 operands converted to float32 for IEEE dots (the interpreter's bf16 dot
    multiplies the raw bits), P rounded to bf16 first as the GPU's dot would take it."""
    kv = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        kv_ok = kv < hi
        blk = tl.load(table_row + kv // BS, mask=kv_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(table_row + kv // BS).to(tl.int64)
    offs = head_base + blk[:, None] * stride_kb + (kv % BS)[:, None] * stride_kl + dims[None, :]
    if MASKED:
        ld = kv_ok[:, None] & (dims[None, :] < D)
        k = tl.load(k_ptr + offs, mask=ld, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + offs, mask=ld, other=0.0)
    elif D == BLOCK_D:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        k = tl.load(k_ptr + offs, mask=dims[None, :] < D, other=0.0)
        v = tl.load(v_ptr + offs, mask=dims[None, :] < D, other=0.0)
    if KV8:  # exact casts; the scales [BLOCK_N] applied below
        s_offs = s_head + blk * stride_sb + (kv % BS) * stride_sl
        if MASKED:
            k_sc = tl.load(ks_ptr + s_offs, mask=kv_ok, other=0.0)
            v_sc = tl.load(vs_ptr + s_offs, mask=kv_ok, other=0.0)
        else:
            k_sc = tl.load(ks_ptr + s_offs)
            v_sc = tl.load(vs_ptr + s_offs)
        k, v = k.to(ACT), v.to(ACT)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
    if KV8:
        s = s * (k_sc * qk_scale)[None, :]
    else:
        s = s * qk_scale  # log2 units: exp2 below
    if SOFTCAP:  # softcap in log2 units too: c * LOG2E
        s = soft_cap(s, softcap)
    if MASKED:
        allowed = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        allowed = allowed & ((window <= 0) | (kv[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV8:
        p = p * v_sc[None, :]  # (P * v_scale) @ e4m3(V): P @ dequantized V
    p = p.to(ACT)
    if UPCAST:
        p = p.to(tl.float32)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def prefill_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    pos_ptr,
    valid_ptr,
    o_ptr,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_sh,
    stride_sl,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_tb,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_ob,
    stride_ot,
    stride_oh,
    T,
    R,
    qk_scale,
    window,
    softcap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
    ACT: tl.constexpr,
    KV8: tl.constexpr,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    head = tl.program_id(0)  # query head = KV head * R + g
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # the last query blocks first
    b = tl.program_id(2).to(tl.int64)
    kv_head, g = head // R, head % R
    t = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # the block's query tokens
    dims = tl.arange(0, BLOCK_D)
    t_ok = t < T
    q_pos = tl.load(pos_ptr + b * T + t, mask=t_ok, other=0)
    q_ok = (tl.load(valid_ptr + b * T + t, mask=t_ok, other=0) != 0) & t_ok
    q_pos = tl.where(q_ok, q_pos, -1)  # padding queries see nothing
    hi = tl.max(q_pos, axis=0) + 1  # KV positions [0, hi): 0 if none
    first = tl.min(tl.where(q_ok, q_pos, hi), axis=0)  # the block's first valid query
    # unmasked steps: n0 .. n0 + BLOCK_N - 1 <= first, and (window) n0 > last - window
    full_hi = (first + 1) // BLOCK_N * BLOCK_N
    windowed = window > 0
    lo = tl.where(windowed, tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    full_lo = tl.where(
        windowed, tl.minimum(tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N, hi), 0
    )
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    q_mask = t_ok[:, None] & (dims[None, :] < D)
    q = tl.load(
        q_ptr
        + b * stride_qb
        + kv_head * stride_qh
        + (g * T + t)[:, None] * stride_qm
        + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    table_row = table_ptr + b * stride_tb
    head_base = kv_head.to(tl.int64) * stride_kh
    s_head = kv_head.to(tl.int64) * stride_sh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, full_lo, BLOCK_N):  # the window's lower edge
        acc, m_i, l_i = _step(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            table_row,
            head_base,
            s_head,
            n0,
            hi,
            q_pos,
            window,
            qk_scale,
            softcap,
            dims,
            stride_kb,
            stride_kl,
            stride_sb,
            stride_sl,
            True,
            BLOCK_N,
            BLOCK_D,
            D,
            BS,
            IEEE,
            ACT,
            KV8,
            UPCAST,
            SOFTCAP,
        )
    for n0 in range(full_lo, full_hi, BLOCK_N):  # seen whole by every query
        acc, m_i, l_i = _step(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            table_row,
            head_base,
            s_head,
            n0,
            hi,
            q_pos,
            window,
            qk_scale,
            softcap,
            dims,
            stride_kb,
            stride_kl,
            stride_sb,
            stride_sl,
            False,
            BLOCK_N,
            BLOCK_D,
            D,
            BS,
            IEEE,
            ACT,
            KV8,
            UPCAST,
            SOFTCAP,
        )
    for n0 in range(full_hi, hi, BLOCK_N):  # the diagonal
        acc, m_i, l_i = _step(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            table_row,
            head_base,
            s_head,
            n0,
            hi,
            q_pos,
            window,
            qk_scale,
            softcap,
            dims,
            stride_kb,
            stride_kl,
            stride_sb,
            stride_sl,
            True,
            BLOCK_N,
            BLOCK_D,
            D,
            BS,
            IEEE,
            ACT,
            KV8,
            UPCAST,
            SOFTCAP,
        )
    # padding queries (l = 0, or garbage from the unmasked steps) write zeros, never NaN
    out = acc / tl.where(q_ok & (l_i > 0), l_i, 1.0)[:, None]
    out = tl.where(q_ok[:, None], out, 0.0)
    tl.store(
        o_ptr
        + b * stride_ob
        + t[:, None].to(tl.int64) * stride_ot
        + head * stride_oh
        + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=q_mask,
    )
