"""Where a decode step's GPU time goes: one model's static-shape step (the workers' path,
runtime/models/runners/step_runner.py) replayed from its CUDA graph under the torch profiler.

Prints the step time with and without CUDA graphs, the kernels of one replayed step grouped by
name (count, GPU time), the GPU-busy fraction of the step (kernel time / step time), and with
--gemm the bandwidth cuBLAS reaches on each of the model's weight shapes at a few row counts.

    python examples/gpu/profile_forward.py --shape 8b --device cuda:0 --tokens 1 --gemm
    python examples/gpu/profile_forward.py --shape 8b --quantization fp8 --tokens 1 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.bench.metrics import copy_bandwidth, step_time
from runtime.models import load_model
from runtime.models.loading.synthetic import SHAPES, build_pair
from runtime.models.runners.step_runner import StepRunner

POSITION, REPLAYS = 300, 5


def kernel_table(runner, device, tokens: int) -> dict:
    """Profile REPLAYS steps; kernels per step grouped by name, and the busy fraction."""
    step_time(runner, device, 1, tokens, POSITION, iters=3, warmup=2)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        seconds = step_time(runner, device, 1, tokens, POSITION, iters=REPLAYS, warmup=0)
    groups: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            groups[ev.name[:90]].append(ev.device_time_total)  # microseconds
    rows = sorted(
        ((sum(v) / REPLAYS, len(v) / REPLAYS, k) for k, v in groups.items()), reverse=True
    )
    busy_us = sum(r[0] for r in rows)
    return {
        "step_ms": 1e3 * seconds,
        "kernel_ms": busy_us / 1e3,
        "kernels_per_step": sum(r[1] for r in rows),
        "busy_fraction": busy_us / 1e6 / seconds,
        "top": [{"us": round(us, 1), "count": n, "name": name} for us, n, name in rows[:30]],
    }


def gemm_bandwidth(model, device, dtype) -> list[dict]:
    """Bytes of weight read per second by F.linear at each distinct weight shape, replayed
    from a CUDA graph of 20 calls (no launch gaps counted)."""
    shapes = sorted(
        {tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n},
        reverse=True,
    )
    out = []
    for n_out, n_in in shapes:
        w = torch.randn(n_out, n_in, device=device, dtype=dtype)
        for rows in (1, 5, 16):
            x = torch.randn(rows, n_in, device=device, dtype=dtype)
            F.linear(x, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    F.linear(x, w)
            graph.replay()
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            torch.cuda.synchronize(device)
            us = start.elapsed_time(end) * 1e3 / 100
            out.append(
                {
                    "shape": [n_out, n_in],
                    "rows": rows,
                    "us": round(us, 2),
                    "TBps": round(w.numel() * w.element_size() / us / 1e6, 3),
                }
            )
        del w
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1], help="tokens per step (1 decode, k+1 verify)"
    )
    ap.add_argument("--role", default="target", choices=["draft", "target"])
    ap.add_argument(
        "--quantization", default=None, choices=["fp8"], help="quantize the synthetic model on load"
    )
    ap.add_argument("--gemm", action="store_true", help="also time F.linear per weight shape")
    ap.add_argument(
        "--slots",
        type=int,
        nargs="+",
        default=[2],
        help="KV cache slots (max batch) of each profiled configuration",
    )
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the workers do
    paths = build_pair(tempfile.mkdtemp(), a.shape, draft_layers=2, dtype=dtype, materialize=False)
    model = load_model(paths[a.role == "target"], dtype, device, quantization=a.quantization)
    report = {"shape": a.shape, "role": a.role, "copy_TBps": copy_bandwidth(device) / 1e12}
    for slots, tokens in ((s, t) for s in a.slots for t in a.tokens):
        model.allocate_cache(slots, 1024)
        eager = StepRunner(model, device, slots, 8, cuda_graphs=False)
        name = f"{tokens}_slots{slots}"
        report[f"eager_{name}_ms"] = 1e3 * step_time(eager, device, 1, tokens, POSITION)
        graphs = StepRunner(model, device, slots, 8, cuda_graphs=True)
        table = kernel_table(graphs, device, tokens)
        report[f"graph_{name}"] = table
        print(
            f"== {a.shape} {a.role} {tokens}-token step, {slots} slots: eager "
            f"{report[f'eager_{name}_ms']:.3f} ms, graph {table['step_ms']:.3f} ms, "
            f"kernels {table['kernel_ms']:.3f} ms ({table['kernels_per_step']:.0f} per step, "
            f"busy {table['busy_fraction']:.2f})",
            flush=True,
        )
        for row in table["top"]:
            print(f"{row['us']:9.1f} us {row['count']:6.1f}x  {row['name']}")
    if a.gemm:
        report["gemm"] = gemm_bandwidth(model, device, dtype)
        for row in report["gemm"]:
            print(
                f"gemm {row['shape']} rows {row['rows']:2d}: {row['us']:8.2f} us "
                f"{row['TBps']:.3f} TB/s"
            )
    print(f"copy bandwidth {report['copy_TBps']:.3f} TB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
