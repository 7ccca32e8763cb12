"""RoPE of the new queries and keys and their KV-cache write in one kernel (Triton).

The eager reference is runtime.models.arch.fused.rotary_write: rotate q [B, T, H, D] and
k [B, T, Hkv, D] (transformers' rotate_half: x * cos + rotate_half(x) * sin), write the
rotated k and v [B, T, Hkv, D] at (block, offset) of each token in the block pools
[N+1, Hkv, BS, D] (runtime.models.arch.cache: ExtendBatch.write_blocks / write_offsets),
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

This module is the host side: NewTokens (a step's q, k, v as the kernels read them), the
launchers and `fits` / `fits_fp8`; the kernel is kernels.rope_kernel, its row loads and
rotation kernels.rope_rows. Steps of several tokens a row skip this kernel:
runtime.models.kernels.attention's partial kernel rotates and writes the step's NewTokens
itself, through rope_rows.new_rows / write_new_kv (the same arithmetic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.models.kernels.fp8_kv import check_pools, scale_args
from runtime.models.kernels.rope_kernel import rope_write_kernel


class NewTokens(NamedTuple):
    """A step's q, k, v before RoPE as the kernels read them: q [B*T, H, D], k, v
    [B*T, Hkv, D] (views: last axis contiguous), cos, sin [B*T, D]; on the fused FP8 path
    slices of the qkv GEMM's raw float32 output with its scales (x_scale [B*T, 1], w_scale
    and bias over the output's columns: raw=True), the activation dtype `dtype` either way."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    dtype: torch.dtype
    seq: int  # T
    scales: tuple | None = None  # (x_scale, w_scale, bias or None)

    @property
    def raw(self) -> bool:
        return self.scales is not None

    def pointers(self) -> tuple:
        """q, k, v, cos, sin, x_scale, w_scale, bias (placeholders where not raw)."""
        x_scale, w_scale, bias = self.scales if self.scales is not None else (self.q, self.q, None)
        return (
            self.q,
            self.k,
            self.v,
            self.cos,
            self.sin,
            x_scale,
            w_scale,
            bias if bias is not None else w_scale,
        )

    def strides(self) -> tuple:
        """q, k, v token and head strides, cos's token stride, x_scale's."""
        x_scale = self.scales[0] if self.scales is not None else self.q
        return (
            self.q.stride(0),
            self.q.stride(1),
            self.k.stride(0),
            self.k.stride(1),
            self.v.stride(0),
            self.v.stride(1),
            self.cos.stride(0),
            x_scale.stride(0),
        )

    def columns(self) -> tuple:
        """R (query heads per KV head) and where k and v start in a raw output's columns."""
        n_heads, n_kv, dim = self.q.shape[1], self.k.shape[1], self.q.shape[2]
        return n_heads // n_kv, n_heads * dim, (n_heads + n_kv) * dim

    @property
    def has_bias(self) -> bool:
        return self.scales is not None and self.scales[2] is not None


def new_tokens(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> NewTokens:
    """NewTokens of q [B, T, H, D], k, v [B, T, Hkv, D], cos, sin [B, T, D] (`fits`)."""
    bsz, seq, _, dim = q.shape
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # [B*T, heads, D]: views (fits)
    return NewTokens(
        q, k, v, cos.reshape(bsz * seq, dim), sin.reshape(bsz * seq, dim), q.dtype, seq
    )


def new_tokens_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    n_heads: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> NewTokens:
    """NewTokens of the raw qkv GEMM output [B*T, (H + 2 Hkv) D] float32 (`fits_fp8`)."""
    bsz, seq, dim = cos.shape
    qkv = raw.view(bsz * seq, -1, dim)
    q, k, v = qkv.split([n_heads, n_kv, n_kv], dim=1)
    return NewTokens(
        q,
        k,
        v,
        cos.reshape(bsz * seq, dim),
        sin.reshape(bsz * seq, dim),
        dtype,
        seq,
        (x_scale, w_scale, bias),
    )


def rotary_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    *scales: torch.Tensor,
) -> torch.Tensor:
    """fused.rotary_write in one kernel: q [B, T, H, D], k, v [B, T, Hkv, D] (last axis
    contiguous), cos, sin [B, T, D]; blocks, offsets [B*T] (where each token's k and v go in
    the pools) -> q rotated, [B, Hkv, r*T, D]. scales: an FP8 cache's k_scale, v_scale
    [N+1, Hkv, BS] (e4m3 pools: fused.rotary_write_kv8), none for float pools.
    D must be a power of two (else the caller keeps fused.rotary_write: `fits`)."""
    if not fits(q, k, v, cos, sin):
        raise ValueError(
            f"rotary_write kernel: head_dim {q.shape[-1]} and last-axis strides "
            f"must fit (q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    return _launch(new_tokens(q, k, v, cos, sin), k_cache, v_cache, blocks, offsets, scales)


def rotary_write_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    n_heads: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    *scales: torch.Tensor,
) -> torch.Tensor:
    """fused.rotary_write_fp8 in one kernel: the raw qkv GEMM output [B*T, (H + 2 Hkv) D]
    float32 with its token scales x_scale [B*T, 1], channel scales w_scale [(H + 2 Hkv) D]
    (and bias) -> q [B, Hkv, r*T, D] in dtype, k and v written to the caches (scales: as
    rotary_write; fused.rotary_write_fp8_kv8). `fits_fp8` says whether it takes these (else
    the caller keeps fused.rotary_write_fp8)."""
    if not fits_fp8(raw, x_scale, w_scale, bias, cos.shape[-1], cos, sin):
        raise ValueError(
            f"rotary_write_fp8 kernel: head_dim {cos.shape[-1]} and the raw "
            f"output {tuple(raw.shape)} / scales must fit"
        )
    new = new_tokens_fp8(raw, x_scale, w_scale, bias, dtype, n_heads, n_kv, cos, sin)
    return _launch(new, k_cache, v_cache, blocks, offsets, scales)


def _launch(new: NewTokens, k_cache, v_cache, blocks, offsets, scales=()) -> torch.Tensor:
    check_pools(k_cache, scales)
    tokens, n_heads, dim = new.q.shape
    n_kv, seq = new.k.shape[1], new.seq
    out = torch.empty(
        tokens // seq, n_kv, n_heads // n_kv * seq, dim, dtype=new.dtype, device=new.q.device
    )
    (q, k, v, cos, sin, x_scale, w_scale, bias), strides = new.pointers(), new.strides()
    rope_write_kernel[(tokens, n_heads + n_kv)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        blocks,
        offsets,
        out,
        x_scale,
        w_scale,
        bias,
        *strides[:7],
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        blocks.stride(0),
        offsets.stride(0),
        strides[7],
        seq,
        n_heads,
        *new.columns(),
        *scale_args(scales, k_cache),
        D=dim,
        HALF=dim // 2,
        RAW=new.raw,
        HAS_BIAS=new.has_bias,
        KV8=bool(scales),
    )
    return out


def fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """Whether the kernel takes these: a power-of-two head_dim, unit last-axis strides, and
    token axes that flatten to one stride (a view: no copy; a [B, 1, ...] decode step always
    does, whatever stride its size-1 axis reports)."""
    dim = q.shape[-1]
    if dim < 2 or dim & (dim - 1) or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        return False
    if cos.stride() != sin.stride():
        return False
    return all(
        t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
        for t in (q, k, v, cos, sin)
    )


def fits_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Whether rotary_write_fp8 takes these: a contiguous raw output [B*T, N] and [N] scales
    (and bias), x_scale [B*T, 1], and cos / sin as `fits` wants them."""
    cols = [t for t in (w_scale, bias) if t is not None]
    if not (
        raw.dim() == 2
        and raw.is_contiguous()
        and x_scale.shape == (raw.shape[0], 1)
        and raw.shape[0] == cos.shape[0] * cos.shape[1]
        and raw.shape[1] % dim == 0
        and all(t.shape == (raw.shape[1],) and t.is_contiguous() for t in cols)
    ):
        return False
    dims = raw.view(*cos.shape[:2], -1, dim)
    return fits(dims, dims, dims, cos, sin)
