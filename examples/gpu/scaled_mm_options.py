"""torch._scaled_mm's options at the 8b decode shapes (e4m3 x e4m3, unit scales, M = 1, 5, 16):
use_fast_accum off / on and a float32 / bf16 output, microseconds per call replayed from a
CUDA graph of 20 calls (median of 10 replays; the same weight every call, so the smaller
weights partly sit in L2: compare the options, not the absolute bandwidths), and the largest
difference of the fast-accumulation product from the exact one. Measured 2026-12-02 on one
H200: no option is faster by more than 3% anywhere (runtime/models/quant.py keeps the exact
accumulation and its float32 output).

    python examples/gpu/scaled_mm_options.py
"""
from __future__ import annotations

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "head": (128256, 4096)}   # [N, K] of the 8b model


def replay_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Median microseconds per call of fn, `calls` of them captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    one = torch.ones((), device="cuda")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") / 8).to(torch.float8_e4m3fn)
        for m in (1, 5, 16):
            x = (torch.randn(m, k, device="cuda") / 8).to(torch.float8_e4m3fn)

            def gemm(fast: bool, out: torch.dtype) -> torch.Tensor:
                return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=out,
                                        use_fast_accum=fast)

            cells = []
            for fast in (False, True):
                for out in (torch.float32, torch.bfloat16):
                    us = replay_us(lambda: gemm(fast, out))
                    cells.append(f"fast={fast} {str(out)[6:]}: {us:.1f} us "
                                 f"({n * k / us / 1e6:.2f} TB/s)")
            exact, quick = gemm(False, torch.float32), gemm(True, torch.float32)
            diff = ((quick - exact).abs().max() / exact.abs().max()).item()
            print(f"{name} M={m}: " + "; ".join(cells) + f"; fast vs exact {diff:.1e}")


if __name__ == "__main__":
    main()
