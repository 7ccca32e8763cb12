"""An experiment, not used by the runtime: the FP8 path's SiLU·up with its per-token e4m3
quantize (runtime.models.arch.fused.silu_mul_fp8) in one launch instead of the three kernels
torch.compile makes of it (the row's amax split over programs, the amax combined, then the
quantize: 6.4 µs a layer at one token on an H200, docs/benchmarks.md).

Grid (tokens, P): program (t, j) reads its columns of the gate_up GEMM's raw float32 output,
rescales them (token scale x channel scales, + bias) and rounds to the activation dtype as
fp8_rescale does, forms silu(gate) * up rounded to that dtype, stores it to a scratch row and
its |max| to a partial, then counts itself in on the token's counter. The program that
arrives last (the counter's old value is P - 1) resets the counter, combines the P partials
into the token's scale (amax / 448) and quantizes the whole scratch row. No program waits on
another, so the kernel is correct in any order of the programs (the Triton interpreter runs
them one after the other) and inside CUDA graphs (the counters end at 0).

    python lab/gpu/silu_quant_kernel.py            # µs against the compiled pieces

Measured on an H200 (2026-12-03, docs/benchmarks.md): slower than the compiled pieces at
every shape (8b, one token: 7.3 µs at best against 4.4; the last program's serial pass over
the row costs more than the launches it saves), so the runtime keeps them.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.models.kernels.combine import _ROUND
from runtime.models.kernels.e4m3 import e4m3_rne


@triton.jit
def _rescaled(raw_ptr, ws_ptr, b_ptr, col, mask, xs, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """Raw GEMM output columns `col` of one token, (raw * xs) * ws (+ bias), in ACT, as
    float32."""
    x = tl.load(raw_ptr + col, mask=mask, other=0.0) * xs * tl.load(ws_ptr + col, mask=mask)
    if HAS_BIAS:
        x = x + tl.load(b_ptr + col, mask=mask).to(tl.float32)
    return x.to(ACT).to(tl.float32)


@triton.jit
def _silu_quant(
    raw_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    h_ptr,
    part_ptr,
    count_ptr,
    out_ptr,
    scale_ptr,
    inter,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    t, j = tl.program_id(0), tl.program_id(1)
    col = j * BLOCK + tl.arange(0, BLOCK)
    mask = col < inter
    row = raw_ptr + t * 2 * inter
    xs = tl.load(xs_ptr + t)
    gate = _rescaled(row, ws_ptr, b_ptr, col, mask, xs, HAS_BIAS, ACT)
    up = _rescaled(row, ws_ptr, b_ptr, col + inter, mask, xs, HAS_BIAS, ACT)
    silu = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)  # F.silu in ACT
    h = (silu * up).to(ACT)
    tl.store(h_ptr + t * inter + col, h, mask=mask)
    tl.store(part_ptr + t * P + j, tl.max(tl.where(mask, tl.abs(h.to(tl.float32)), 0.0), 0))
    if tl.atomic_add(count_ptr + t, 1, sem="acq_rel") == P - 1:  # the last one in
        tl.atomic_xchg(count_ptr + t, 0)
        amax = tl.max(tl.load(part_ptr + t * P + tl.arange(0, P), volatile=True), 0)
        scale = tl.maximum(amax, 1e-12) / 448.0
        tl.store(scale_ptr + t, scale)
        for start in range(0, inter, FINAL):  # FINAL columns a step
            c = start + tl.arange(0, FINAL)
            v = tl.load(h_ptr + t * inter + c, mask=c < inter, other=0.0, volatile=True)
            q = tl.minimum(tl.maximum(v.to(tl.float32) / scale, -448.0), 448.0)
            tl.store(out_ptr + t * inter + c, e4m3_rne(q).to(tl.float8e4nv), mask=c < inter)


class SiluQuant:
    """Buffers for one shape (tokens, intermediate size): scratch rows, partials and the
    per-token counters (zero between calls), reused by every call, so calls can be captured
    in CUDA graphs."""

    def __init__(
        self,
        tokens: int,
        inter: int,
        dtype: torch.dtype,
        device,
        block: int = 1024,
        final: int | None = None,
        warps: int = 4,
    ):
        """block: columns a program; final: columns a step of the last program's quantize
        loop (default block); warps: a program's warps."""
        self.tokens, self.inter, self.dtype, self.block = tokens, inter, dtype, block
        self.final, self.warps = final or block, warps
        # a power of two (the partials are combined in one tl.arange); programs past the
        # row's end have no columns and count in with a partial of 0
        self.programs = triton.next_power_of_2(triton.cdiv(inter, block))
        self.h = torch.empty(tokens, inter, dtype=dtype, device=device)
        self.partials = torch.zeros(tokens, self.programs, dtype=torch.float32, device=device)
        self.counters = torch.zeros(tokens, dtype=torch.int32, device=device)

    def __call__(
        self,
        raw: torch.Tensor,
        x_scale: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fused.silu_mul_fp8(raw [M, 2I] float32, x_scale [M, 1], w_scale [2I], bias, dtype):
        ([M, I] e4m3, [M, 1] float32)."""
        m = raw.shape[0]
        assert raw.shape == (self.tokens, 2 * self.inter) and raw.is_contiguous(), raw.shape
        out = torch.empty(m, self.inter, dtype=torch.float8_e4m3fn, device=raw.device)
        scale = torch.empty(m, 1, dtype=torch.float32, device=raw.device)
        _silu_quant[(m, self.programs)](
            raw,
            x_scale,
            w_scale,
            w_scale if bias is None else bias,
            self.h,
            self.partials,
            self.counters,
            out,
            scale,
            self.inter,
            P=self.programs,
            BLOCK=self.block,
            FINAL=self.final,
            HAS_BIAS=bias is not None,
            ACT=_ROUND[self.dtype],
            num_warps=self.warps,
        )
        return out, scale


# (columns a program, columns a step of the last program's quantize, warps a program)
VARIANTS = [(1024, 1024, 4), (1024, 4096, 8), (2048, 4096, 8), (512, 4096, 8), (1024, 8192, 16)]


def main() -> None:
    from lab.gpu.kernel_bench import graphed_us
    from runtime.models.arch import fused

    device, dtype = torch.device("cuda"), torch.bfloat16
    fused.compile_kernels(device)
    for inter in (14336, 28672):  # the 8b and 70b MLPs
        for tokens in (1, 5, 16):
            raw = torch.randn(tokens, 2 * inter, device=device) * 30
            xs = torch.rand(tokens, 1, device=device) / 100
            ws = torch.rand(2 * inter, device=device) / 100
            want_q, want_scale = fused.silu_mul_fp8(raw, xs, ws, None, dtype)
            compiled_us = graphed_us(lambda: fused.silu_mul_fp8(raw, xs, ws, None, dtype))
            print(f"I {inter} tokens {tokens}: compiled {compiled_us:.1f} us", flush=True)
            for block, final, warps in VARIANTS:
                ours = SiluQuant(tokens, inter, dtype, device, block, final, warps)
                q, scale = ours(raw, xs, ws)
                kernel_us = graphed_us(lambda: ours(raw, xs, ws))
                print(
                    f"  block {block} final {final} warps {warps}: kernel {kernel_us:.1f} "
                    f"us; scales equal {torch.equal(scale, want_scale)}, e4m3 values "
                    f"differing {int((q.float() != want_q.float()).sum())} of {q.numel()}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
