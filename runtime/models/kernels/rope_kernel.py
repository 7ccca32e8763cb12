"""The RoPE + KV-write Triton kernel that kernels.rope launches (rotary_write,
rotary_write_fp8): one program per (token, head), q heads first, then KV heads. A q head's
program stores its rotated row at its stacked place in the output [B, Hkv, r*T, D]
(fused.stack_heads); a KV head's stores the rotated key and the value at (block, offset) of
the token in the block pools, quantized with a scale per row into e4m3 pools (KV8:
kernels.fp8_kv). RAW: q, k and v are slices of the qkv GEMM's raw float32 output, rescaled
as they load (kernels.rope_rows.load_masked)."""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.models.kernels.fp8_kv import kv_quantize, kv_scale
from runtime.models.kernels.rope_rows import load_masked


@triton.jit
def rope_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    blocks_ptr,
    offs_ptr,
    out_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_cs,
    stride_ch,
    stride_cl,
    stride_ob,
    stride_oh,
    stride_om,
    stride_blk,
    stride_off,
    stride_xs,
    T,
    H,
    R,
    KV_COL,
    V_COL,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_sh,
    stride_sl,
    D: tl.constexpr,
    HALF: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    KV8: tl.constexpr,
):
    tok, head = tl.program_id(0), tl.program_id(1)  # tok = b * T + t; head < H: a q head
    act = out_ptr.dtype.element_ty
    dims = tl.arange(0, HALF)
    cs = tok * stride_ct
    cos_lo = tl.load(cos_ptr + cs + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs + HALF + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs + dims).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs + HALF + dims).to(tl.float32)
    xs = 1.0
    if RAW:
        xs = tl.load(xs_ptr + tok * stride_xs)
    if head < H:
        src, col = q_ptr + tok * stride_qt + head * stride_qh, head * D
    else:
        src, col = k_ptr + tok * stride_kt + (head - H) * stride_kh, KV_COL + (head - H) * D
    whole = dims < HALF  # every element: one head's half
    lo = load_masked(src + dims, col + dims, whole, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, act)
    hi = load_masked(
        src + HALF + dims, col + HALF + dims, whole, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, act
    )
    rot_lo = lo * cos_lo - hi * sin_lo  # rotate_half: (-hi, lo)
    rot_hi = hi * cos_hi + lo * sin_hi
    if head < H:
        b, t = tok // T, tok % T
        dst = out_ptr + b * stride_ob + (head // R) * stride_oh + ((head % R) * T + t) * stride_om
        tl.store(dst + dims, rot_lo.to(act))
        tl.store(dst + HALF + dims, rot_hi.to(act))
    else:
        kv = head - H
        blk = tl.load(blocks_ptr + tok * stride_blk).to(tl.int64)
        off = tl.load(offs_ptr + tok * stride_off).to(tl.int64)
        at = blk * stride_cs + kv * stride_ch + off * stride_cl
        full = tl.arange(0, D)
        if KV8:
            _write_kv8(
                rot_lo.to(act).to(tl.float32),
                rot_hi.to(act).to(tl.float32),
                v_ptr + tok * stride_vt + kv * stride_vh,
                V_COL + kv * D,
                xs,
                ws_ptr,
                b_ptr,
                kc_ptr + at,
                vc_ptr + at,
                blk * stride_sb + kv * stride_sh + off * stride_sl,
                ks_ptr,
                vs_ptr,
                D,
                HALF,
                RAW,
                HAS_BIAS,
                act,
            )
        else:
            tl.store(kc_ptr + at + dims, rot_lo.to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + at + HALF + dims, rot_hi.to(kc_ptr.dtype.element_ty))
            v = load_masked(
                v_ptr + tok * stride_vt + kv * stride_vh + full,
                V_COL + kv * D + full,
                full < D,
                xs,
                ws_ptr,
                b_ptr,
                RAW,
                HAS_BIAS,
                act,
            )
            tl.store(vc_ptr + at + full, v.to(vc_ptr.dtype.element_ty))


@triton.jit
def _write_kv8(
    k_lo,
    k_hi,
    v_src,
    v_col,
    xs,
    ws_ptr,
    b_ptr,
    kc,
    vc,
    s_at,
    ks_ptr,
    vs_ptr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    """One token's KV head into e4m3 pools: the rotated key's halves k_lo, k_hi [HALF]
    (ACT values, float32) and its value (v_src / v_col: element 0's pointer / raw column),
    each quantized with one scale (fp8_kv) at kc / vc, the scales at s_at of ks / vs."""
    dims, full = tl.arange(0, HALF), tl.arange(0, D)
    k_sc = kv_scale(tl.maximum(tl.max(tl.abs(k_lo), axis=0), tl.max(tl.abs(k_hi), axis=0)))
    tl.store(kc + dims, kv_quantize(k_lo, k_sc))
    tl.store(kc + HALF + dims, kv_quantize(k_hi, k_sc))
    tl.store(ks_ptr + s_at, k_sc)
    v = load_masked(v_src + full, v_col + full, full < D, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
    v_sc = kv_scale(tl.max(tl.abs(v), axis=0))
    tl.store(vc + full, kv_quantize(v, v_sc))
    tl.store(vs_ptr + s_at, v_sc)
