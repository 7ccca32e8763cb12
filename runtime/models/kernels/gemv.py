"""Small-M linears (decode, verify): y = f(x) @ (W * s)^T + b, reading the weight once.

The eager references: F.linear for float weights; runtime.models.quant.fp8_linear's
weight-only path (F.linear over fused.fp8_dequantize) for e4m3 weights with per-channel
scales; for `silu_mul`, F.linear(fused.silu_mul(x), ...).

At decode sizes (M = 1..MAX_M rows) a linear is a weight read: every weight byte once, a few
multiply-adds each. One program per BLOCK_N output channels walks the whole K axis: it loads a
[BLOCK_N, BLOCK_K] weight tile (e4m3 is widened to the activation dtype in registers, exactly:
every e4m3 value is a bf16 / fp16 / float32 value) and a [BLOCK_M, BLOCK_K] activation tile,
accumulates their product in float32 on the tensor cores, and applies the per-channel scale
and bias once at the end. So an FP8 weight costs no activation quantization and no separate
rescale kernel, and the activations keep their precision (weight-only FP8, as vLLM's Marlin
FP8 kernels do): two kernels fewer per FP8 linear than torch._scaled_mm, and more exact.

`silu_mul=True` folds the MLP's SiLU(gate) * up into the down projection's input: x is
[M, 2K] (gate | up) and the product, rounded to x.dtype as fused.silu_mul rounds it, is formed
tile by tile as it is loaded (the [M, K] intermediate never goes to memory).

Tile sizes are autotuned per (N, K, BLOCK_M, weight dtype) on first use; the step runner's
warm-up run does that before any CUDA graph is captured.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 16   # rows at most: one BLOCK_M tile (tl.dot needs 16)

_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4),
                               (32, 128, 4, 4), (64, 128, 4, 4), (16, 1024, 8, 3),
                               (32, 512, 8, 3), (64, 256, 8, 3)]]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                 stride_xm, stride_wn, stride_ym,
                 W_BYTES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = row_ok[:, None] & (ks[None, :] < K)
        x_offs = rows[:, None] * stride_xm + ks[None, :]
        x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)                 # [BM, BK]
        if SILU_MUL:   # x holds gate; up sits K columns further on
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0)
            gate = x.to(tl.float32)
            x = (gate * tl.sigmoid(gate)).to(up.dtype) * up
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)    # [BN, BK]
        w = w.to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))                                   # [BM, BN]
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# on CUDA the tile sizes are autotuned per shape; the interpreter (CPU tests) cannot time
# kernels, so there one small fixed tile runs
_gemv_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M", "W_BYTES"])(_gemv_kernel)
INTERPRET_TILE = {"BLOCK_N": 16, "BLOCK_K": 32}


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (or [..., 2K] gate | up with silu_mul) @ (weight [N, K] * scale [N])^T
    + bias [N] -> [..., N] in x.dtype. weight: x.dtype or e4m3 (then scale, float32, is
    required); at most MAX_M rows of x."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, (n, k) = rows.shape[0], weight.shape
    if m > MAX_M or rows.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
                         f"(silu_mul={silu_mul}, at most {MAX_M} rows)")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)                  # noqa: E731
    kernel, tile = (_gemv_tuned, {}) if x.is_cuda else (_gemv_kernel, INTERPRET_TILE)
    kernel[grid](
        rows, weight, scale if scale is not None else out,
        bias if bias is not None else out, out, m, n, k,
        rows.stride(0), weight.stride(0), out.stride(0),
        W_BYTES=weight.element_size(), HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32,
        BLOCK_M=MAX_M, **tile)
    return out.view(*x.shape[:-1], n)
