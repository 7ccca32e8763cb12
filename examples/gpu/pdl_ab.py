"""Programmatic dependent launch of the torch.compile'd pieces on and off (runtime.models.fused.
pdl_supported), side by side in one process: one synthetic model's decode and verify steps
replayed from their CUDA graphs (the workers' path, runtime/models/step_runner.py), GPU time
per step from CUDA events over REPLAYS back-to-back replays, the two modes taking turns:

    none   no PDL (what TANDEM_PDL=0 gives)
    pdl    inductor's enable_pdl (the default on Hopper)

Each turn recompiles the pieces with the mode's setting and recaptures the graphs; the median
per mode over the rounds, and the paired ratio none / pdl (above 1: PDL is faster).
Each step's logits are compared with the first `none` run's (they must be equal bit for bit:
PDL changes when a kernel starts, not what it computes).

    python examples/gpu/pdl_ab.py --shape 8b --quantization fp8 --rounds 3 --out pdl.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.models import fused, load_model  # noqa: E402
from runtime.models.step_runner import StepRunner  # noqa: E402
from runtime.models.synthetic import build_pair  # noqa: E402

MODES = {"none": False, "pdl": True}
POSITION, REPLAYS = 300, 50


def set_mode(name: str, device: torch.device) -> None:
    """Recompile the pieces with inductor's PDL switch set for `name`."""
    os.environ["TANDEM_PDL"] = "1" if MODES[name] else "0"
    fused.use_eager()
    torch._dynamo.reset()
    fused.compile_kernels(device)       # sets the switch by fused.pdl_supported


def gpu_step_us(model, device, tokens: int, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Capture the step's graph (a fresh StepRunner), then GPU microseconds per replay."""
    batch = ids.shape[0]
    runner = StepRunner(model, device, batch, 8, cuda_graphs=True)
    for _ in range(3):   # captures, then replays
        logits = runner.run(ids, list(range(batch)), [POSITION] * batch, [tokens] * batch)
    logits = logits.clone()                     # a view the next step would overwrite
    graph = next(iter(runner.graphs.values()))
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) * 1e3 / REPLAYS
    del runner, graph
    gc.collect()
    torch.cuda.empty_cache()
    return us, logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.backends.cuda.enable_cudnn_sdp(False)   # as the workers do
    paths = build_pair(tempfile.mkdtemp(), a.shape, draft_layers=2, dtype=dtype,
                       materialize=False)
    model = load_model(paths[1], dtype, device, quantization=a.quantization)
    model.allocate_cache(a.batch, 1024)
    gen = torch.Generator().manual_seed(1)
    ids = {t: torch.randint(0, model.vocab_size, (a.batch, t), generator=gen).to(device)
           for t in a.tokens}
    times: dict = {t: {m: [] for m in MODES} for t in a.tokens}
    reference: dict = {}
    max_diff = 0.0
    order = list(MODES)
    for r in range(a.rounds):
        for mode in (order if r % 2 == 0 else order[::-1]):
            set_mode(mode, device)
            for t in a.tokens:
                us, out = gpu_step_us(model, device, t, ids[t])
                times[t][mode].append(us)
                ref = reference.setdefault(t, out)
                max_diff = max(max_diff, (out.float() - ref.float()).abs().max().item())
                print(f"round {r} {mode:6s} {t}-token step {us:8.1f} us", flush=True)
    report = {"shape": a.shape, "batch": a.batch, "dtype": a.dtype, "quantization": a.quantization,
              "replays": REPLAYS, "steps_us": times, "median_us": {}, "paired_vs_none": {},
              "max_abs_logit_diff_across_modes": max_diff}
    for t in a.tokens:
        med = {m: statistics.median(v) for m, v in times[t].items()}
        ratios = {m: statistics.median(n / x for n, x in zip(times[t]["none"], v))
                  for m, v in times[t].items() if m != "none"}
        report["median_us"][t], report["paired_vs_none"][t] = med, ratios
        print(f"== {t}-token step: " + ", ".join(f"{m} {v:.1f} us" for m, v in med.items())
              + "; none / mode: " + ", ".join(f"{m} {v:.3f}x" for m, v in ratios.items()))
    print(f"largest logit difference across modes: {max_diff}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
