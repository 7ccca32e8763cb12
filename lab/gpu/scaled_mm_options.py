"""torch._scaled_mm's options at the 8b decode shapes (e4m3 x e4m3, unit scales, M = 1, 5, 16):
use_fast_accum off / on and a float32 / bf16 output, microseconds per call replayed from a
CUDA graph of 20 calls (kernel_bench.graphed_us; the same weight every call, so the smaller
weights partly sit in L2: compare the options, not the absolute bandwidths), and the largest
difference of the fast-accumulation product from the exact one. Measured 2026-12-02 on one
H200: no option is faster by more than 3% at M = 1 or 5, the decode and verify shapes
(runtime/models/arch/quant.py keeps the exact accumulation and its float32 output).

    python lab/gpu/scaled_mm_options.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from lab.gpu.gemv_bench import layer_shapes
from lab.gpu.kernel_bench import graphed_us
from runtime.models.loading.synthetic import SHAPES


def main() -> None:
    torch.manual_seed(0)
    one = torch.ones((), device="cuda")
    shapes = {
        **layer_shapes("8b"),  # name -> [N, K]
        "head": (SHAPES["8b"]["vocab_size"], SHAPES["8b"]["hidden_size"]),
    }
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") / 8).to(torch.float8_e4m3fn)
        for m in (1, 5, 16):
            x = (torch.randn(m, k, device="cuda") / 8).to(torch.float8_e4m3fn)

            def gemm(fast: bool, out: torch.dtype) -> torch.Tensor:
                return torch._scaled_mm(
                    x, w.t(), scale_a=one, scale_b=one, out_dtype=out, use_fast_accum=fast
                )

            cells = []
            for fast in (False, True):
                for out in (torch.float32, torch.bfloat16):
                    us = graphed_us(lambda: gemm(fast, out))
                    cells.append(
                        f"fast={fast} {str(out)[6:]}: {us:.1f} us ({n * k / us / 1e6:.2f} TB/s)"
                    )
            exact, quick = gemm(False, torch.float32), gemm(True, torch.float32)
            diff = ((quick - exact).abs().max() / exact.abs().max()).item()
            print(f"{name} M={m}: " + "; ".join(cells) + f"; fast vs exact {diff:.1e}")


if __name__ == "__main__":
    main()
