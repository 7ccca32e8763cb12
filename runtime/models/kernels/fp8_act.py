"""The FP8 path's activation kernels: a residual add + RMSNorm, or SiLU(gate)·up, quantized per
token for the next FP8 GEMM, one Triton program per row (token).

The eager references are runtime.models.fused.add_rms_norm_fp8 / rms_norm_fp8 /
silu_mul_fp8: the previous unscaled GEMM's raw float32 output rescaled (x_scale per token,
w_scale per channel, + bias) and rounded to the activation dtype, the add / norm / SiLU·up in
that dtype's rounding points, then fp8_quantize_rows (scale = amax / 448 of the row, values
divided by it, clamped, cast to e4m3). Compiled by torch.compile, silu_mul_fp8 at one token
was three kernels (the row's amax split over programs, then combined, then the quantize:
6.4 us on an H200) and each norm one looped reduction (3.4 us); here each is one program
holding its whole row, so a decode step launches one kernel for each.

The e4m3 cast rounds to nearest-even in float32 arithmetic first (`e4m3_rne`), so the cast
itself is exact: the GPU's conversion and the Triton interpreter's (which does not round to
nearest-even) give the bytes torch's `.to(torch.float8_e4m3fn)` gives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
MAX_BLOCK = 32768     # a row of at most this many outputs is held in registers at once


@triton.jit
def e4m3_rne(v):
    """float32 v, |v| <= 448 -> the e4m3 value nearest (ties to even), still float32: the
    spacing is 2^(e - 3) for exponent e >= -6, 2^-9 below (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.math.div_rn(tl.abs(v), ulp)                # exact: a power of two
    r = (r + 12582912.0) - 12582912.0                 # 1.5 * 2^23: rounds to an integer, RNE
    return tl.where(bits < 0, -(r * ulp), r * ulp)    # the sign, -0.0 included


@triton.jit
def _rescaled(raw_ptr, cols, ok, xs, ws_ptr, b_ptr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """Raw GEMM output at cols, (raw * x_scale) * w_scale (+ bias), rounded to ACT, float32."""
    v = tl.load(raw_ptr + cols, mask=ok, other=0.0) * xs * tl.load(ws_ptr + cols, mask=ok,
                                                                   other=0.0)
    if HAS_BIAS:
        v = v + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return v.to(ACT).to(tl.float32)


@triton.jit
def _quantize(h, ok, q_ptr, qs_ptr):
    """Store the row h (float32, masked by ok) as e4m3 at q_ptr and its scale at qs_ptr."""
    amax = tl.max(tl.where(ok, tl.abs(h), 0.0), axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    v = tl.minimum(tl.maximum(tl.math.div_rn(h, scale), -448.0), 448.0)
    tl.store(q_ptr, e4m3_rne(v).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(qs_ptr, scale)


@triton.jit
def _norm_kernel(x_ptr, d_ptr, xs_ptr, ws_ptr, b_ptr, w_ptr, s_ptr, q_ptr, qs_ptr,
                 stride_x, stride_d, stride_xs, stride_s, stride_q, K, eps,
                 BLOCK: tl.constexpr, DELTA: tl.constexpr, RAW: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    act = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if DELTA:
        if RAW:
            d = _rescaled(d_ptr + row * stride_d, cols, ok, tl.load(xs_ptr + row * stride_xs),
                          ws_ptr, b_ptr, HAS_BIAS, act)
        else:
            d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        s = (s + d).to(act)
        tl.store(s_ptr + row * stride_s + cols, s, mask=ok)
        s = s.to(tl.float32)
    h = s * tl.math.rsqrt(tl.sum(s * s, axis=0) / K + eps)
    h = (tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
         * h.to(act).to(tl.float32)).to(act).to(tl.float32)         # weight * h in act
    _quantize(h, ok, q_ptr + row * stride_q + cols, qs_ptr + row)


@triton.jit
def _silu_kernel(raw_ptr, xs_ptr, ws_ptr, b_ptr, q_ptr, qs_ptr, stride_r, stride_xs, stride_q,
                 I, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < I
    xs = tl.load(xs_ptr + row * stride_xs)
    gate = _rescaled(raw_ptr + row * stride_r, cols, ok, xs, ws_ptr, b_ptr, HAS_BIAS, ACT)
    up = _rescaled(raw_ptr + row * stride_r + I, cols, ok, xs, ws_ptr + I, b_ptr + I,
                   HAS_BIAS, ACT)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(ACT).to(tl.float32)
    _quantize((silu * up).to(ACT).to(tl.float32), ok, q_ptr + row * stride_q + cols, qs_ptr + row)


def _outputs(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(m, k, dtype=FP8, device=device),
            torch.empty(m, 1, dtype=torch.float32, device=device))


def _warps(block: int) -> int:
    return max(4, min(32, block // 1024))


def add_rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, x_scale: torch.Tensor | None = None,
                     w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """fused.add_rms_norm_fp8 (delta [M, K] in x.dtype, or raw float32 with x_scale [M, 1],
    w_scale [K], bias) -> (x + delta [M, K], e4m3 [M, K], scale [M, 1]); delta None:
    fused.rms_norm_fp8 -> (e4m3, scale). x [M, K] with unit last-axis strides (`fits`)."""
    m, k = x.shape
    q8, qs = _outputs(m, k, x.device)
    s = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    raw = x_scale is not None
    block = triton.next_power_of_2(k)
    _norm_kernel[(m,)](
        x, d, x_scale if raw else x, w_scale if raw else x,
        bias if bias is not None else x, weight, s, q8, qs,
        x.stride(0), d.stride(0), x_scale.stride(0) if raw else 0, s.stride(0), q8.stride(0),
        k, eps, BLOCK=block, DELTA=delta is not None, RAW=raw, HAS_BIAS=bias is not None,
        num_warps=_warps(block))
    return (s, q8, qs) if delta is not None else (q8, qs)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.rms_norm_fp8: x [M, K] -> (e4m3 [M, K], scale [M, 1])."""
    return add_rms_norm_fp8(x, None, weight, eps)


def silu_mul_fp8(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.silu_mul_fp8: the raw gate_up GEMM output [M, 2I] float32, its scales x_scale
    [M, 1], w_scale [2I] (and bias) -> silu(gate) * up quantized: (e4m3 [M, I], [M, 1])."""
    m, i = raw.shape[0], raw.shape[1] // 2
    q8, qs = _outputs(m, i, raw.device)
    block = triton.next_power_of_2(i)
    _silu_kernel[(m,)](
        raw, x_scale, w_scale, bias if bias is not None else w_scale, q8, qs,
        raw.stride(0), x_scale.stride(0), q8.stride(0), i, BLOCK=block,
        HAS_BIAS=bias is not None, ACT=_TL_DTYPES[dtype], num_warps=_warps(block))
    return q8, qs


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float32: tl.float32}


def fits_norm(x: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """Whether add_rms_norm_fp8 takes these: rows [M, K] (and delta [M, K]) with unit
    last-axis strides, K at most MAX_BLOCK."""
    return (x.dim() == 2 and x.shape[1] <= MAX_BLOCK and x.stride(1) == 1
            and (delta is None or (delta.shape == x.shape and delta.stride(1) == 1)))


def fits_silu(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether silu_mul_fp8 takes this raw gate_up output [M, 2I]: unit last-axis stride,
    I at most MAX_BLOCK, a float activation dtype."""
    return (raw.dim() == 2 and raw.shape[1] % 2 == 0 and raw.shape[1] // 2 <= MAX_BLOCK
            and raw.stride(1) == 1 and dtype in _TL_DTYPES)
