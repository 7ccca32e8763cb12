"""RoPE of the new tokens' rows and their KV-cache write, a tile at a time (Triton device
functions).

load_masked reads elements of q, k or v in float32, applying the fused FP8 path's qkv GEMM
epilogue where they are raw (rescaled per token and channel, + bias, rounded to the
activation dtype: fused.fp8_rescale); rotated applies RoPE to a tile of heads. The RoPE
kernel (kernels.rope_kernel) loads through load_masked; attention's partial kernel
(kernels.attention_partial) rotates its queries with new_rows and writes the step's new keys
and values with write_new_kv, the same arithmetic as the RoPE kernel (kernels.rope_kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.models.kernels.fp8_kv import kv_quantize, kv_scale


@triton.jit
def load_masked(
    src, col, mask, xs, ws_ptr, b_ptr, RAW: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr
):
    """Elements at src in float32 (src / col: the elements' pointers and, RAW, their columns
    of a raw FP8 GEMM output; any shape; masked elements read 0). RAW: times the token's
    scale xs (broadcast) and the columns' scales (+ bias), rounded to the activation dtype ACT
    (fused.fp8_rescale's order: (raw * xs) * ws + bias)."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    if RAW:
        x = x * xs * tl.load(ws_ptr + col, mask=mask, other=0.0)
        if HAS_BIAS:
            x = x + tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
        x = x.to(ACT).to(tl.float32)
    return x


@triton.jit
def rotated(
    src,
    col,
    dims,
    mask,
    cos,
    sin,
    xs,
    ws_ptr,
    b_ptr,
    HALF: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    """RoPE of a tile of heads, float32: src / col the pointers / raw columns of each row's
    element 0 ([R, 1]), dims [1, D], cos / sin [R, D] float32. The same arithmetic as
    rope_kernel.rope_write_kernel (lo * cos - hi * sin, hi * cos + lo * sin), the halves read twice
    instead of split: runtime.models.kernels.attention folds it into its partial kernel."""
    low = dims < HALF
    swap = tl.where(low, dims + HALF, dims - HALF)
    x = load_masked(src + dims, col + dims, mask, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
    x_sw = load_masked(src + swap, col + swap, mask, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
    return tl.where(low, x * cos - x_sw * sin, x * cos + x_sw * sin)


@triton.jit
def new_rows(
    src,
    col,
    tok,
    ok,
    dims,
    cos_ptr,
    sin_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    stride_ct,
    stride_xs,
    ROTATE: tl.constexpr,
    D: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    """Rows of the step's new q / k (ROTATE) or v (runtime.models.kernels.attention's partial
    kernel reads them through these two): src / col [R, 1] each row's element 0 and
    raw column, tok [R] its token, ok [R]; float32 [R, BLOCK_D], masked rows 0."""
    mask = ok[:, None] & (dims[None, :] < D)
    xs = 1.0
    if RAW:
        xs = tl.load(xs_ptr + tok * stride_xs, mask=ok, other=0.0)[:, None]
    if ROTATE:
        at = tok[:, None] * stride_ct + dims[None, :]
        cos = tl.load(cos_ptr + at, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=mask, other=0.0).to(tl.float32)
        return rotated(
            src,
            col,
            dims[None, :],
            mask,
            cos,
            sin,
            xs,
            ws_ptr,
            bias_ptr,
            D // 2,
            RAW,
            HAS_BIAS,
            ACT,
        )
    return load_masked(
        src + dims[None, :], col + dims[None, :], mask, xs, ws_ptr, bias_ptr, RAW, HAS_BIAS, ACT
    )


@triton.jit
def write_new_kv(
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
    s_head,
    stride_sb,
    stride_sl,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    T_POW2: tl.constexpr,
    BS: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    KV8: tl.constexpr,
):
    """KV head h of row b's valid new tokens at positions in [start, stop): k rotated, v as
    is, stored to the block pools through the row's block table (table_row: its first
    entry): block table_row[pos // BS], offset pos % BS, head_base = the head's offset.
    KV8: e4m3 pools, each row (rounded to ACT) quantized (fp8_kv), its scale stored at
    s_head (the head's offset in the scales) + block * stride_sb + offset * stride_sl."""
    ts = tl.arange(0, T_POW2)
    dims = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + b * T + ts, mask=ts < T, other=-1)
    ok = (ts < T) & (tl.load(valid_ptr + b * T + ts, mask=ts < T, other=0) != 0)
    ok = ok & (pos >= start) & (pos < stop)
    tok = b * T + ts
    k = new_rows(
        nk_ptr + tok[:, None] * stride_nkt + h * stride_nkh,
        KV_COL + h * D,
        tok,
        ok,
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
    )
    v = new_rows(
        nv_ptr + tok[:, None] * stride_nvt + h * stride_nvh,
        V_COL + h * D,
        tok,
        ok,
        dims,
        cos_ptr,
        sin_ptr,
        xs_ptr,
        ws_ptr,
        bias_ptr,
        stride_ct,
        stride_xs,
        False,
        D,
        RAW,
        HAS_BIAS,
        ACT,
    )
    blk = tl.load(table_row + pos // BS, mask=ok, other=0).to(tl.int64)
    at = (
        head_base
        + blk[:, None] * stride_kb
        + (pos % BS)[:, None].to(tl.int64) * stride_kl
        + dims[None, :]
    )
    mask = ok[:, None] & (dims[None, :] < D)
    if KV8:
        s_at = s_head + blk * stride_sb + (pos % BS).to(tl.int64) * stride_sl  # [T_POW2]
        k = k.to(ACT).to(tl.float32)  # v: ACT values already
        k_sc = kv_scale(tl.max(tl.abs(k), axis=1))
        v_sc = kv_scale(tl.max(tl.abs(v), axis=1))
        tl.store(k_ptr + at, kv_quantize(k, k_sc[:, None]), mask=mask)
        tl.store(v_ptr + at, kv_quantize(v, v_sc[:, None]), mask=mask)
        tl.store(ks_ptr + s_at, k_sc, mask=ok)
        tl.store(vs_ptr + s_at, v_sc, mask=ok)
    else:
        tl.store(k_ptr + at, k.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=mask)
