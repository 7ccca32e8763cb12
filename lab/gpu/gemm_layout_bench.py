"""Microbenchmark of the decode GEMMs' operand order and of weights found in L2, on one
decoder layer's shapes of the synthetic models (what the runtime might change in
runtime/models/arch/quant.py and the float linears):

- `x @ W^T` as the runtime runs it (F.linear for bf16, torch._scaled_mm(x8, W8^T) unscaled for
  FP8) against the swapped product `W @ x^T` (the weight as the GEMM's M side: the few tokens
  become N, padded to 16 rows for _scaled_mm, which needs multiples of 16), which lets a
  library tile the long weight axis across all SMs ("swap AB", as CUTLASS small-M kernels do);
- cold weights (each call reads another copy of the weight, the copies together far larger
  than L2: what a decode step sees) against hot ones (the same weight every call: what an L2
  prefetch could at best give).

Each figure is microseconds per call replayed from a CUDA graph; GB/s counts the weight bytes
against the measured copy bandwidth. The swapped products are checked against the plain ones.

    python lab/gpu/gemm_layout_bench.py --out gemm_layout.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from lab.gpu.gemv_bench import layer_shapes
from runtime.bench.metrics import copy_bandwidth
from runtime.models.arch import fused, quant

COLD_BYTES = 512 << 20  # the weight copies of one cold measurement, in all
PAD = 16  # _scaled_mm's N granularity


def graphed_cycle_us(fns) -> float:
    """Microseconds per call of the callables fns, each once, in order, from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def variants(n: int, k: int, m: int, copies: int) -> dict[str, list]:
    """name -> one callable per weight copy."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    w16 = [torch.randn(n, k, device=dev, dtype=bf16) * 0.02 for _ in range(copies)]
    w8 = [quant.quantize_rows(w.float())[0] for w in w16]
    x = torch.randn(m, k, device=dev, dtype=bf16)
    x8 = fused.fp8_quantize_rows(x)[0]
    x8_pad = torch.zeros(max(PAD, m), k, device=dev, dtype=quant.FP8)
    x8_pad[:m] = x8
    one = torch.ones((), device=dev)
    return {
        "bf16 x@W^T": [lambda w=w: F.linear(x, w) for w in w16],
        "bf16 W@x^T": [lambda w=w: torch.mm(w, x.t()) for w in w16],
        "fp8 x@W^T": [
            lambda w=w: torch._scaled_mm(
                x8, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            )
            for w in w8
        ],
        "fp8 W@x^T": [
            lambda w=w: torch._scaled_mm(
                w, x8_pad.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            )
            for w in w8
        ],
    }


def check(fns: dict[str, list], m: int) -> float:
    """Largest relative difference of the swapped products against the plain ones."""
    worst = 0.0
    for kind in ("bf16", "fp8"):
        plain = fns[f"{kind} x@W^T"][0]().float()  # [M, N]
        swapped = fns[f"{kind} W@x^T"][0]().float()[:, :m].t()  # [M, N]
        worst = max(worst, ((plain - swapped).norm() / plain.norm()).item())
    return worst


def case(shape: str, name: str, n: int, k: int, m: int) -> dict:
    copies = max(2, -(-COLD_BYTES // (n * k)))
    fns = variants(n, k, m, copies)
    row = {
        "shape": shape,
        "linear": name,
        "N": n,
        "K": k,
        "M": m,
        "copies": copies,
        "swap_rel_diff": check(fns, m),
    }
    for label, calls in fns.items():
        nbytes = n * k * (2 if label.startswith("bf16") else 1)
        cold = graphed_cycle_us(calls)
        hot = graphed_cycle_us([calls[0]] * len(calls))
        row[label] = {
            "cold_us": round(cold, 2),
            "hot_us": round(hot, 2),
            "cold_GBps": round(nbytes / cold / 1e3, 1),
        }
    del fns
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8b,70b")
    ap.add_argument("--m", default="1,5,16")
    args = ap.parse_args()
    copy = copy_bandwidth(torch.device("cuda"))
    rows = [
        case(shape, name, n, k, m)
        for shape in args.shapes.split(",")
        for name, (n, k) in layer_shapes(shape).items()
        for m in (int(v) for v in args.m.split(","))
    ]
    labels = ("bf16 x@W^T", "bf16 W@x^T", "fp8 x@W^T", "fp8 W@x^T")
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; cold us (GB/s) / hot us")
    print("| shape | linear | M | " + " | ".join(labels) + " | swap rel diff |")
    print("|---|---|---|" + "---|" * (len(labels) + 1))
    for r in rows:
        cells = [
            f"{r[lb]['cold_us']:.1f} ({r[lb]['cold_GBps']:.0f}) / {r[lb]['hot_us']:.1f}"
            for lb in labels
        ]
        print(
            f"| {r['shape']} | {r['linear']} | {r['M']} | "
            + " | ".join(cells)
            + f" | {r['swap_rel_diff']:.1e} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_GBps": copy / 1e9, "rows": rows}, f, indent=1)
    worst = max(r["swap_rel_diff"] for r in rows)
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
