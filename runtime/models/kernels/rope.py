"""RoPE of the new queries and keys and their KV-cache write in one kernel (Triton).

The eager reference is runtime.models.fused.rotary_write: rotate q [B, T, H, D] and
k [B, T, Hkv, D] (transformers' rotate_half: x * cos + rotate_half(x) * sin), write the
rotated k and v [B, T, Hkv, D] at (slot, position) of each token in the caches [S, Hkv, L, D],
and return q with its heads stacked per KV head [B, Hkv, r*T, D] (fused.stack_heads), the
layout the attention kernel reads. Compiled by torch.compile this is two kernels (the cache
writes, the query rotation); here it is one: a program per (token, head), q heads first,
then KV heads, which also copy v. q, k and v may be the strided column slices of the fused
qkv GEMM's output; cos and sin arrive in the activation dtype and the arithmetic is float32,
rounded once (as the compiled version computes it).

On the fused FP8 path (fused.rotary_write_fp8) the same kernel also applies the qkv GEMM's
epilogue: q, k and v are slices of its raw float32 output, rescaled per token and per
channel (+ bias) and rounded to the activation dtype before the rotation, as fp8_rescale
does; compiled, that path was two kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load(src, col, dims, xs, ws_ptr, b_ptr, RAW: tl.constexpr, HAS_BIAS: tl.constexpr,
          ACT: tl.constexpr):
    """Elements dims of one head at src, in float32; RAW: a raw FP8 GEMM output whose
    columns start at col, times the token's scale xs and the columns' scales (+ bias), rounded
    to the activation dtype ACT (fused.fp8_rescale's order: (raw * xs) * ws + bias)."""
    x = tl.load(src + dims).to(tl.float32)
    if RAW:
        x = x * xs * tl.load(ws_ptr + col + dims)
        if HAS_BIAS:
            x = x + tl.load(b_ptr + col + dims).to(tl.float32)
        x = x.to(ACT).to(tl.float32)
    return x


@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                       slots_ptr, pos_ptr, out_ptr, xs_ptr, ws_ptr, b_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ct, stride_cs, stride_ch, stride_cl,
                       stride_ob, stride_oh, stride_om, stride_slot, stride_pos, stride_xs,
                       T, H, R, KV_COL, V_COL,
                       D: tl.constexpr, HALF: tl.constexpr, RAW: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
    tok, head = tl.program_id(0), tl.program_id(1)      # tok = b * T + t; head < H: a q head
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
    lo = _load(src, col, dims, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, act)
    hi = _load(src + HALF, col + HALF, dims, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, act)
    rot_lo = lo * cos_lo - hi * sin_lo                   # rotate_half: (-hi, lo)
    rot_hi = hi * cos_hi + lo * sin_hi
    if head < H:
        b, t = tok // T, tok % T
        dst = out_ptr + b * stride_ob + (head // R) * stride_oh + ((head % R) * T + t) * stride_om
        tl.store(dst + dims, rot_lo.to(act))
        tl.store(dst + HALF + dims, rot_hi.to(act))
    else:
        kv = head - H
        slot = tl.load(slots_ptr + tok * stride_slot).to(tl.int64)
        pos = tl.load(pos_ptr + tok * stride_pos).to(tl.int64)
        at = slot * stride_cs + kv * stride_ch + pos * stride_cl
        tl.store(kc_ptr + at + dims, rot_lo.to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + at + HALF + dims, rot_hi.to(kc_ptr.dtype.element_ty))
        full = tl.arange(0, D)
        v = _load(v_ptr + tok * stride_vt + kv * stride_vh, V_COL + kv * D, full, xs, ws_ptr,
                  b_ptr, RAW, HAS_BIAS, act)
        tl.store(vc_ptr + at + full, v.to(vc_ptr.dtype.element_ty))


def rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fused.rotary_write in one kernel: q [B, T, H, D], k, v [B, T, Hkv, D] (last axis
    contiguous), cos, sin [B, T, D]; slots, positions [B*T] -> q rotated, [B, Hkv, r*T, D].
    D must be a power of two (else the caller keeps fused.rotary_write: `fits`)."""
    if not fits(q, k, v, cos, sin):
        raise ValueError(f"rotary_write kernel: head_dim {q.shape[-1]} and last-axis strides "
                         f"must fit (q {tuple(q.shape)}, k {tuple(k.shape)})")
    return _launch(q, k, v, cos, sin, k_cache, v_cache, slots, positions, q.dtype, None)


def rotary_write_fp8(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype, n_heads: int, n_kv: int,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """fused.rotary_write_fp8 in one kernel: the raw qkv GEMM output [B*T, (H + 2 Hkv) D]
    float32 with its token scales x_scale [B*T, 1], channel scales w_scale [(H + 2 Hkv) D]
    (and bias) -> q [B, Hkv, r*T, D] in dtype, k and v written to the caches. `fits_fp8`
    says whether it takes these (else the caller keeps fused.rotary_write_fp8)."""
    bsz, seq, dim = cos.shape
    if not fits_fp8(raw, x_scale, w_scale, bias, dim, cos, sin):
        raise ValueError(f"rotary_write_fp8 kernel: head_dim {dim} and the raw output "
                         f"{tuple(raw.shape)} / scales must fit")
    qkv = raw.view(bsz, seq, -1)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    q, k, v = (t.view(bsz, seq, -1, dim) for t in (q, k, v))
    return _launch(q, k, v, cos, sin, k_cache, v_cache, slots, positions, dtype,
                   (x_scale, w_scale, bias))


def _launch(q, k, v, cos, sin, k_cache, v_cache, slots, positions, dtype, scales
            ) -> torch.Tensor:
    bsz, seq, n_heads, dim = q.shape
    n_kv = k.shape[2]
    out = torch.empty(bsz, n_kv, n_heads // n_kv * seq, dim, dtype=dtype, device=q.device)
    tokens = bsz * seq
    q2, k2, v2 = (t.flatten(0, 1) for t in (q, k, v))   # [B*T, heads, D]: views (fits)
    cos2, sin2 = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    x_scale, w_scale, bias = scales if scales is not None else (q2, q2, None)
    _rope_write_kernel[(tokens, n_heads + n_kv)](
        q2, k2, v2, cos2, sin2, k_cache, v_cache, slots, positions, out,
        x_scale, w_scale, bias if bias is not None else w_scale,
        q2.stride(0), q2.stride(1), k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1),
        cos2.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), slots.stride(0), positions.stride(0),
        x_scale.stride(0), seq, n_heads, n_heads // n_kv, n_heads * dim, (n_heads + n_kv) * dim,
        D=dim, HALF=dim // 2, RAW=scales is not None, HAS_BIAS=bias is not None)
    return out


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> bool:
    """Whether the kernel takes these: a power-of-two head_dim, unit last-axis strides, and
    token axes that flatten to one stride (a view: no copy)."""
    dim = q.shape[-1]
    if dim < 2 or dim & (dim - 1) or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        return False
    if cos.stride() != sin.stride():
        return False
    return all(t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
               for t in (q, k, v, cos, sin))


def fits_fp8(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether rotary_write_fp8 takes these: a contiguous raw output [B*T, N] and [N] scales
    (and bias), x_scale [B*T, 1], and cos / sin as `fits` wants them."""
    cols = [t for t in (w_scale, bias) if t is not None]
    if not (raw.dim() == 2 and raw.is_contiguous() and x_scale.shape == (raw.shape[0], 1)
            and raw.shape[0] == cos.shape[0] * cos.shape[1] and raw.shape[1] % dim == 0
            and all(t.shape == (raw.shape[1],) and t.is_contiguous() for t in cols)):
        return False
    dims = raw.view(*cos.shape[:2], -1, dim)
    return fits(dims, dims, dims, cos, sin)
