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

Steps of several tokens a row skip this kernel: runtime.models.kernels.attention's partial
kernel rotates and writes the step's NewTokens itself, through new_rows / write_new_kv here
(the same arithmetic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.models.kernels.fp8_kv import check_pools, kv_quantize, kv_scale, scale_args


@triton.jit
def _load_masked(
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
    _rope_write_kernel (lo * cos - hi * sin, hi * cos + lo * sin), the halves read twice
    instead of split: runtime.models.kernels.attention folds it into its partial kernel."""
    low = dims < HALF
    swap = tl.where(low, dims + HALF, dims - HALF)
    x = _load_masked(src + dims, col + dims, mask, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
    x_sw = _load_masked(src + swap, col + swap, mask, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
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
    return _load_masked(
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


@triton.jit
def _rope_write_kernel(
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
    lo = _load_masked(src + dims, col + dims, whole, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, act)
    hi = _load_masked(
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
            v = _load_masked(
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
    v = _load_masked(v_src + full, v_col + full, full < D, xs, ws_ptr, b_ptr, RAW, HAS_BIAS, ACT)
    v_sc = kv_scale(tl.max(tl.abs(v), axis=0))
    tl.store(vc + full, kv_quantize(v, v_sc))
    tl.store(vs_ptr + s_at, v_sc)


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
    _rope_write_kernel[(tokens, n_heads + n_kv)](
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
