"""Where a decode step's GPU time goes: one model's static-shape step (the workers' path,
runtime/models/step_runner.py) run eagerly under the torch profiler, kernels sorted by GPU
time, plus the step time with and without CUDA graphs.

    python examples/profile_forward.py --shape 1b --device cuda:0
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.bench.metrics import step_time  # noqa: E402
from runtime.models import load_model  # noqa: E402
from runtime.models.step_runner import StepRunner  # noqa: E402
from runtime.synthetic import build_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per step (1 decode, k+1 verify)")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)   # as the workers do
    _, target = build_pair(tempfile.mkdtemp(), a.shape, draft_layers=2, dtype=dtype,
                           gen_device=device)
    model = load_model(target, dtype, device)
    model.allocate_cache(2, 1024)
    for graphs in (False, True):
        runner = StepRunner(model, device, 2, 8, cuda_graphs=graphs)
        ms = 1e3 * step_time(runner, device, 1, a.tokens, 300)
        print(f"{a.shape} {a.dtype} {a.tokens}-token step, graphs={graphs}: {ms:.3f} ms",
              flush=True)
    runner = StepRunner(model, device, 2, 8, cuda_graphs=False)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step_time(runner, device, 1, a.tokens, 300, iters=5, warmup=0)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
