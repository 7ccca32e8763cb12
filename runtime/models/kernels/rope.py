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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                       slots_ptr, pos_ptr, out_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ct, stride_cs, stride_ch, stride_cl,
                       stride_ob, stride_oh, stride_om, stride_slot, stride_pos,
                       T, H, R,
                       D: tl.constexpr, HALF: tl.constexpr):
    tok, head = tl.program_id(0), tl.program_id(1)      # tok = b * T + t; head < H: a q head
    dims = tl.arange(0, HALF)
    cs = tok * stride_ct
    cos_lo = tl.load(cos_ptr + cs + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs + HALF + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs + dims).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs + HALF + dims).to(tl.float32)
    if head < H:
        src = q_ptr + tok * stride_qt + head * stride_qh
    else:
        src = k_ptr + tok * stride_kt + (head - H) * stride_kh
    lo = tl.load(src + dims).to(tl.float32)
    hi = tl.load(src + HALF + dims).to(tl.float32)
    rot_lo = lo * cos_lo - hi * sin_lo                   # rotate_half: (-hi, lo)
    rot_hi = hi * cos_hi + lo * sin_hi
    if head < H:
        b, t = tok // T, tok % T
        dst = out_ptr + b * stride_ob + (head // R) * stride_oh + ((head % R) * T + t) * stride_om
        tl.store(dst + dims, rot_lo.to(out_ptr.dtype.element_ty))
        tl.store(dst + HALF + dims, rot_hi.to(out_ptr.dtype.element_ty))
    else:
        kv = head - H
        slot = tl.load(slots_ptr + tok * stride_slot).to(tl.int64)
        pos = tl.load(pos_ptr + tok * stride_pos).to(tl.int64)
        at = slot * stride_cs + kv * stride_ch + pos * stride_cl
        tl.store(kc_ptr + at + dims, rot_lo.to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + at + HALF + dims, rot_hi.to(kc_ptr.dtype.element_ty))
        v_src = v_ptr + tok * stride_vt + kv * stride_vh
        full = tl.arange(0, D)
        tl.store(vc_ptr + at + full, tl.load(v_src + full).to(vc_ptr.dtype.element_ty))


def rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fused.rotary_write in one kernel: q [B, T, H, D], k, v [B, T, Hkv, D] (last axis
    contiguous), cos, sin [B, T, D]; slots, positions [B*T] -> q rotated, [B, Hkv, r*T, D].
    D must be a power of two (else the caller keeps fused.rotary_write: `fits`)."""
    bsz, seq, n_heads, dim = q.shape
    n_kv = k.shape[2]
    if not fits(q, k, v, cos, sin):
        raise ValueError(f"rotary_write kernel: head_dim {dim} and last-axis strides must "
                         f"fit (q {tuple(q.shape)}, k {tuple(k.shape)})")
    out = torch.empty(bsz, n_kv, n_heads // n_kv * seq, dim, dtype=q.dtype, device=q.device)
    tokens = bsz * seq
    q2, k2, v2 = (t.flatten(0, 1) for t in (q, k, v))   # [B*T, heads, D]: views (fits)
    cos2, sin2 = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    _rope_write_kernel[(tokens, n_heads + n_kv)](
        q2, k2, v2, cos2, sin2, k_cache, v_cache, slots, positions, out,
        q2.stride(0), q2.stride(1), k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1),
        cos2.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), slots.stride(0), positions.stride(0),
        seq, n_heads, n_heads // n_kv, D=dim, HALF=dim // 2)
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
