"""An experiment, kept with its benchmark (lab/gpu/gemv_bench.py): a Triton small-M
linear, y = f(x) @ (W * s)^T + b, for decode and verify, bf16 or e4m3 weights.

Measured on an H200 (docs/benchmarks.md, the evening of 2026-12-01: "Tried and measured"), it loses
to cuBLAS (bf16) and torch._scaled_mm (FP8) at every decode shape of the 8b model, so the
runtime does not use it; it is here so that the measurement can be rerun and the design
improved.

Design: one program per BLOCK_N output channels and K slice (split-K, SPLIT slices: short
output rows would leave most SMs idle); e4m3 weight tiles are widened to the activation dtype
in registers (exact) and multiplied on the tensor cores above DOT_M rows, on the CUDA cores at
or below; each slice stores its partial sums and the last slice of a column block to finish
(an atomic counter) adds them in slice order (deterministic), applies the per-channel scale
and bias and resets the counter. `silu_mul=True` forms SiLU(gate) * up while loading x
[M, 2K]. Tiles and the split are autotuned per shape.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_M = 16  # rows at most
DOT_M = 4  # above this many rows, tensor cores (tl.dot needs a 16-row tile); else CUDA cores
MAX_SPLIT = 8  # K-slices at most (split-K: short rows of N would leave most SMs idle)


def _configs(dot: bool) -> list:
    """(BLOCK_N, BLOCK_K, SPLIT, warps): a few shapes of the work per program."""
    tiles = [(16, 256), (32, 256), (16, 512)] if dot else [(8, 512), (16, 256), (32, 128)]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT": split}, num_warps=4, num_stages=3)
        for n, k in tiles
        for split in (1, 2, 4, 8)
    ]


@triton.jit
def _epilogue(
    acc,
    s_ptr,
    b_ptr,
    y_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    stride_ym,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    W_BYTES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    IEEE: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_len = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K  # this slice of K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * k_len, tl.minimum(pid_k * k_len + k_len, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = row_ok[:, None] & (ks[None, :] < K)
        x_offs = rows[:, None] * stride_xm + ks[None, :]
        x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)  # [BM, BK]
        if SILU_MUL:  # x holds gate; up sits K columns further on
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0)
            gate = x.to(tl.float32)
            x = (gate * tl.sigmoid(gate)).to(up.dtype) * up
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :],
            mask=col_ok[:, None] & (ks[None, :] < K),
            other=0.0,
        )  # [BN, BK]
        if DOT:
            if IEEE:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # [BM, BN]
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SPLIT == 1:
        _epilogue(
            acc, s_ptr, b_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_ym, HAS_SCALE, HAS_BIAS
        )
    else:
        # each slice stores its partial sums; the last slice of this column block to finish
        # (a counter) adds them in slice order (deterministic), applies the epilogue and
        # resets the counter for the next call
        ws = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(ws + pid_k * BLOCK_M * N, acc, mask=row_ok[:, None] & col_ok[None, :])
        if tl.atomic_add(count_ptr + pid_n, 1) == SPLIT - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in range(SPLIT):
                total += tl.load(
                    ws + part * BLOCK_M * N,
                    cache_modifier=".cg",
                    mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _epilogue(
                total,
                s_ptr,
                b_ptr,
                y_ptr,
                rows,
                cols,
                row_ok,
                col_ok,
                stride_ym,
                HAS_SCALE,
                HAS_BIAS,
            )


# on CUDA the work split is autotuned per shape; the interpreter (the CPU test,
# tests/unit/models/test_gemv_experiment.py) cannot time kernels, so there fixed small tiles
# run, split in two (both epilogues tested)
_KEY = ["N", "K", "BLOCK_M", "W_BYTES", "SILU_MUL"]
_tuned = {
    dot: triton.autotune(
        configs=_configs(dot),
        key=_KEY,
        do_bench=functools.partial(triton.testing.do_bench, warmup=3, rep=10),
    )(_gemv_kernel)
    for dot in (False, True)
}
INTERPRET_TILE = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT": 2}
_workspace: dict = {}


def workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums [MAX_SPLIT, 16, n] float32, counters per 8-column block [n / 8] int32,
    zero: every call leaves them zero) for outputs of n columns on `device`, made on first
    use (a warm-up run, before any CUDA graph capture) and kept."""
    key = (device, n)
    if key not in _workspace:
        _workspace[key] = (
            torch.empty(MAX_SPLIT * 16 * n, dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, 8), dtype=torch.int32, device=device),
        )
    return _workspace[key]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [..., K] (or [..., 2K] gate | up with silu_mul) @ (weight [N, K] * scale [N])^T
    + bias [N] -> [..., N] in x.dtype. weight: x.dtype or e4m3 (then scale, float32, is
    required); at most MAX_M rows of x."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, (n, k) = rows.shape[0], weight.shape
    if m > MAX_M or rows.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(
            f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
            f"(silu_mul={silu_mul}, at most {MAX_M} rows)"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, count = workspace(x.device, n)
    dot = m > DOT_M
    block_m = 16 if dot else triton.next_power_of_2(m)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])  # noqa: E731
    kernel, tile = (_tuned[dot], {}) if x.is_cuda else (_gemv_kernel, INTERPRET_TILE)
    kernel[grid](
        rows,
        weight,
        scale if scale is not None else out,
        bias if bias is not None else out,
        out,
        part,
        count,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        W_BYTES=weight.element_size(),
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        IEEE=x.dtype == torch.float32,
        DOT=dot,
        BLOCK_M=block_m,
        **tile,
    )
    return out.view(*x.shape[:-1], n)
