"""Settings of a decode step side by side in one process: one synthetic model's decode and
verify steps replayed from their CUDA graphs (the workers' path,
runtime/models/runners/step_runner.py),
GPU time per step from CUDA events over REPLAYS back-to-back replays, the modes taking turns:

    none         no programmatic dependent launch, cuBLAS
    pdl          inductor's enable_pdl (the default on Hopper), cuBLAS: what the workers run
    lt           pdl, and torch's cuBLASLt backend for bf16/fp16 GEMMs
                 (torch.backends.cuda.preferred_blas_library("cublaslt"))
    lt-nosplitk  lt, and no split-K reductions in bf16/fp16 GEMMs
                 (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction =
                 (False, False))
    nofold       pdl, with RoPE and the KV write in their own kernel, not folded into the
                 attention kernel
    foldall      pdl, RoPE folded into the attention kernel in every step, decode included
                 (kernels.attention.FOLD_ROPE_MIN_SEQ = 1)
    cdt          pdl, the pieces compiled with inductor's coordinate_descent_tuning (each
                 kernel's block sizes and warps tuned by timing it at compile time)
    cdt-all      cdt, trying every direction of the search (coordinate_descent_check_all_
                 directions) and a wider search radius

Each turn applies its mode, recompiles the torch.compile'd pieces and recaptures the graphs;
the median per mode over the rounds, the paired ratio first mode / mode (above 1: the mode is
faster), and the kernels a step launches (torch profiler over a few replays). Each step's
logits are compared with the first mode's first run: PDL changes when a kernel starts, not
what it computes (0.0 expected); another GEMM algorithm may add in another order.

    python lab/gpu/step_ab.py --shape 8b --quantization fp8 --rounds 3 --out pdl.json
    python lab/gpu/step_ab.py --shape 8b --modes pdl lt lt-nosplitk --batch 16
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
import torch._inductor.config as inductor_config

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.models import load_model
from runtime.models.arch import fused
from runtime.models.kernels import attention as attention_kernel
from runtime.models.loading.synthetic import build_pair
from runtime.models.runners.step_runner import StepRunner

# mode: (PDL, torch's BLAS backend for bf16/fp16 GEMMs, split-K allowed in them, RoPE folded
# into the attention kernel from this many tokens a row on: 0 never)
FOLD = attention_kernel.FOLD_ROPE_MIN_SEQ
NEVER = 1 << 30
MODES = {
    "none": (False, "cublas", True, FOLD),
    "pdl": (True, "cublas", True, FOLD),
    "lt": (True, "cublaslt", True, FOLD),
    "lt-nosplitk": (True, "cublaslt", False, FOLD),
    "nofold": (True, "cublas", True, 0),
    "foldall": (True, "cublas", True, 1),
    "cdt": (True, "cublas", True, FOLD),
    "cdt-all": (True, "cublas", True, FOLD),
}
PDL_SUPPORTED = fused.pdl_supported  # the runtime's rule; mode `none` overrides it
# inductor settings of a mode (torch._inductor.config), applied before the pieces compile
INDUCTOR = {
    "cdt": {"coordinate_descent_tuning": True},
    "cdt-all": {
        "coordinate_descent_tuning": True,
        "coordinate_descent_check_all_directions": True,
        "coordinate_descent_search_radius": 2,
    },
}
INDUCTOR_DEFAULTS = {
    key: getattr(inductor_config, key) for options in INDUCTOR.values() for key in options
}
REDUCTIONS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
POSITION, REPLAYS, PROFILED = 300, 50, 5


_compiled: list = [None]  # the (PDL, inductor settings) the pieces were last compiled with


def set_mode(name: str, device: torch.device) -> None:
    """Apply `name`'s settings; recompile the pieces when PDL or the inductor settings
    (compile-time switches) change."""
    pdl, library, splitk, fold = MODES[name]
    # compile_kernels sets inductor's PDL switch by fused.pdl_supported
    fused.pdl_supported = PDL_SUPPORTED if pdl else (lambda device: False)
    attention_kernel.FOLD_ROPE_MIN_SEQ = fold or NEVER  # read when the graphs are captured
    for attr in REDUCTIONS:  # torch's defaults, or no split-K (needs full precision)
        setattr(torch.backends.cuda.matmul, attr, True if splitk else (False, False))
    torch.backends.cuda.preferred_blas_library(library)
    options = INDUCTOR.get(name, {})
    if _compiled[0] != (pdl, options):
        for key, value in {**INDUCTOR_DEFAULTS, **options}.items():
            setattr(inductor_config, key, value)
        fused.use_eager()
        torch._dynamo.reset()
        fused.compile_kernels(device)  # sets the PDL switch by fused.pdl_supported
        _compiled[0] = (pdl, options)


def kernels_per_replay(graph) -> float:
    """CUDA kernels (and memory operations) one replay of `graph` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.replay()
        torch.cuda.synchronize()
    return sum(ev.device_type == torch.autograd.DeviceType.CUDA for ev in prof.events()) / PROFILED


def gpu_step_us(
    model, device, tokens: int, ids: torch.Tensor, count: bool
) -> tuple[float, torch.Tensor, float | None]:
    """Capture the step's graph (a fresh StepRunner), then GPU microseconds per replay, its
    logits and (when `count`) its kernels per replay."""
    batch = ids.shape[0]
    runner = StepRunner(model, device, batch, 8, cuda_graphs=True)
    for _ in range(3):  # captures, then replays
        logits = runner.run(ids, list(range(batch)), [POSITION] * batch, [tokens] * batch)
    logits = logits.clone()  # a view the next step would overwrite
    graph = next(iter(runner.graphs.values()))
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) * 1e3 / REPLAYS
    kernels = kernels_per_replay(graph) if count else None
    del runner, graph
    gc.collect()
    torch.cuda.empty_cache()
    return us, logits, kernels


def summary(times: dict, modes: list[str]) -> tuple[dict, dict]:
    """Median µs per mode, and the median paired ratio first mode / mode."""
    med = {m: statistics.median(times[m]) for m in modes}
    base = times[modes[0]]
    ratios = {m: statistics.median(b / x for b, x in zip(base, times[m])) for m in modes[1:]}
    return med, ratios


def measure(model, device, ids: dict, modes: list[str], rounds: int) -> tuple[dict, dict, dict]:
    """The modes taking turns for `rounds` rounds, each step length of `ids` (tokens -> [B, T]
    ids) in each: µs per run, kernels per step, largest logit difference from the first."""
    times: dict = {t: {m: [] for m in modes} for t in ids}
    kernels: dict = {t: {} for t in ids}
    reference: dict = {}
    diffs = {m: 0.0 for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            set_mode(mode, device)
            for t in ids:
                us, out, n = gpu_step_us(model, device, t, ids[t], mode not in kernels[t])
                times[t][mode].append(us)
                if n is not None:
                    kernels[t][mode] = n
                ref = reference.setdefault(t, out)
                diffs[mode] = max(diffs[mode], (out.float() - ref.float()).abs().max().item())
                print(f"round {r} {mode:12s} {t}-token step {us:8.1f} us", flush=True)
    return times, kernels, diffs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--modes", nargs="+", default=["none", "pdl"], choices=list(MODES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the workers do
    paths = build_pair(tempfile.mkdtemp(), a.shape, draft_layers=2, dtype=dtype, materialize=False)
    model = load_model(paths[1], dtype, device, quantization=a.quantization)
    model.allocate_cache(a.batch, 1024)
    gen = torch.Generator().manual_seed(1)
    ids = {
        t: torch.randint(0, model.vocab_size, (a.batch, t), generator=gen).to(device)
        for t in a.tokens
    }
    times, kernels, diffs = measure(model, device, ids, a.modes, a.rounds)
    report = {
        "shape": a.shape,
        "batch": a.batch,
        "dtype": a.dtype,
        "quantization": a.quantization,
        "modes": a.modes,
        "replays": REPLAYS,
        "steps_us": times,
        "median_us": {},
        f"paired_vs_{a.modes[0]}": {},
        "kernels_per_step": kernels,
        f"max_abs_logit_diff_vs_{a.modes[0]}": diffs,
    }
    for t in a.tokens:
        med, ratios = summary(times[t], a.modes)
        report["median_us"][t], report[f"paired_vs_{a.modes[0]}"][t] = med, ratios
        print(
            f"== {t}-token step: "
            + ", ".join(f"{m} {v:.1f} us ({kernels[t][m]:.0f} kernels)" for m, v in med.items())
            + f"; {a.modes[0]} / mode: "
            + ", ".join(f"{m} {v:.3f}x" for m, v in ratios.items())
        )
    print(
        "largest logit difference against the first mode: "
        + ", ".join(f"{m} {v}" for m, v in diffs.items())
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
