"""Time one model's forward_extend (decode step and verify step) per dtype, with the torch
profiler's top operators: a quick look at where a step's time goes.

    python examples/profile_forward.py --shape 1b --device cuda:0
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.models import load_model  # noqa: E402
from runtime.synthetic import build_pair  # noqa: E402


def step_time(model, device, tokens: int, iters: int = 20) -> float:
    ids = torch.randint(0, model.vocab_size, (1, tokens), device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    n = torch.full((1,), tokens, device=device)
    start = torch.full((1,), 64, device=device)
    for _ in range(3):
        model.forward_extend(ids, slots, start, n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        model.forward_extend(ids, slots, start, n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    device = torch.device(a.device)
    _, target = build_pair(tempfile.mkdtemp(), a.shape, draft_layers=2)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(target, dtype, device)
        model.allocate_cache(2, 1024)
        print(dtype, {name: p.device for name, p in list(model.named_parameters())[:2]},
              {name: b.device for name, b in model.named_buffers()})
        print(f"{dtype}: decode {step_time(model, device, 1) * 1e3:.2f} ms, "
              f"verify(5) {step_time(model, device, 5) * 1e3:.2f} ms", flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            step_time(model, device, 1, iters=5)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        del model


if __name__ == "__main__":
    main()
