"""GPU check of FP8 weights (runtime/models/arch/quant.py, fp8_load.py).

1. Float exactness: a synthetic target quantized on load (`quantization: fp8`), float32
   activations (the weight-only GEMM), ragged prompts decoded greedily through the eager
   forward_extend and through StepRunner's CUDA graphs: tokens and logits compared.
2. The FP8 GEMM (bf16 activations, dynamic per-token scales, torch._scaled_mm with unit
   scales, both scales applied after it) against the weight-only GEMM on the same FP8
   weights: teacher-forced top-1 agreement and logit error; the fused path (quant.FUSE_FP8:
   quantize and rescale folded into the neighbouring kernels) against the unfused one (eager:
   expected bit for bit equal), and the Triton kernels' path (RoPE with the qkv rescale,
   attention) against the fused one; one decoder layer's GEMM shapes at M = 1, 4, 16 timed in
   CUDA graphs against bf16 F.linear, with the FP8 path's parts; one layer's elementwise
   kernels around the FP8 GEMMs, unfused sequence vs fused functions.
3. Decode and verify step times, bf16 weights vs FP8 weights fused and unfused (CUDA graphs),
   the fused vs unfused logits of a compiled prefill, and the bytes a step reads
   (runtime.bench.metrics.weight_bytes_per_step).
4. With --fit: a 70b target and an 8b draft, both FP8 (synthetic recipes quantized on load),
   on one GPU: memory after loading, and the KV cache that fits beside them.

    python examples/gpu/fp8_check.py --shape 8b --out fp8.json           # on an H100 / H200
    python examples/gpu/fp8_check.py --shape 8b --fit --out fp8.json     # + the 70b fit
    python examples/gpu/fp8_check.py --shape tiny --device cpu            # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from examples.gpu.graphs_check import decode
from runtime.bench.metrics import step_time, weight_bytes_per_step
from runtime.models import (
    kernels,
    load_model,
)
from runtime.models.arch import fused, quant
from runtime.models.loading.synthetic import SHAPES, build_pair
from runtime.models.runners.step_runner import StepRunner

SLOTS, CACHE_LEN, K = 4, 640, 4
GIB = 1024**3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 5, 300)]


def exactness(target: str, device, steps: int) -> dict:
    model = load_model(target, torch.float32, device, quantization="fp8")
    ps = prompts(model.vocab_size)
    eager_tokens, eager_logits = decode(model, device, ps, steps, graphs=False)
    graph_tokens, graph_logits = decode(model, device, ps, steps, graphs=True)
    return {
        "tokens_equal": eager_tokens == graph_tokens,
        "max_abs_logit_diff": (eager_logits - graph_logits).abs().max().item(),
        "steps": steps,
        "batch": len(ps),
    }


def _teacher_forced(model, device, ps) -> torch.Tensor:
    model.allocate_cache(1, CACHE_LEN)
    return torch.cat(
        [
            model.forward_extend(
                torch.tensor([p], device=device),
                *(torch.tensor([v], device=device) for v in (0, 0, len(p))),
            )[0].float()
            for p in ps
        ]
    )  # [T, V]


def gemm_paths(target: str, device) -> dict:
    """FP8 GEMM (fused, the default) vs weight-only on the same FP8 weights, bf16 activations:
    the logits of one teacher-forced pass over the prompts (after a divergent token, a random
    model's continuations are not comparable); and fused vs unfused FP8 GEMM path."""
    model = load_model(target, torch.bfloat16, device, quantization="fp8")
    ps = prompts(model.vocab_size)
    x = torch.randn(4, model.args.hidden_size, device=device, dtype=torch.bfloat16)
    layer = model.model.layers[0]
    out = {
        "fp8_gemm_used": quant.uses_fp8_gemm(x, layer.mlp.down_proj.weight),
        "fused_path_used": layer.self_attn.fp8_fused(x) and layer.mlp.fp8_fused(x),
    }
    logits = {}
    was_compiled = fused._compiled
    fused.use_eager()  # eager pieces: fused and unfused must then agree bit for bit
    kernels.disable()  # (a StepRunner before this turned the Triton kernels on)
    for name, fp8_gemm, fuse in (
        ("fused", True, True),
        ("unfused", True, False),
        ("weight_only", False, True),
        ("kernels", True, True),
    ):
        quant.FP8_GEMM, quant.FUSE_FP8 = fp8_gemm, fuse
        if name == "kernels":  # the Triton kernels (RoPE with the qkv rescale, attention)
            kernels.enable(device)
        try:
            logits[name] = _teacher_forced(model, device, ps)
        finally:
            quant.FP8_GEMM, quant.FUSE_FP8 = True, True
            kernels.disable()
    if was_compiled:
        fused.compile_kernels(device)
    a, b, c = logits["fused"], logits["weight_only"], logits["unfused"]
    out.update(
        positions=a.shape[0],
        top1_agreement=(a.argmax(-1) == b.argmax(-1)).float().mean().item(),
        rel_logit_err=((a - b).norm() / b.norm()).item(),
        unfused_top1_agreement=(c.argmax(-1) == b.argmax(-1)).float().mean().item(),
        unfused_rel_logit_err=((c - b).norm() / b.norm()).item(),
        fused_vs_unfused_eager_max_abs_logit_diff=(a - c).abs().max().item(),
        fused_vs_unfused_top1_agreement=(a.argmax(-1) == c.argmax(-1)).float().mean().item(),
        kernels_vs_fused_top1_agreement=(logits["kernels"].argmax(-1) == a.argmax(-1))
        .float()
        .mean()
        .item(),
        kernels_vs_fused_rel_logit_err=((logits["kernels"] - a).norm() / a.norm()).item(),
    )
    return out


def _graph_time(fn, calls: int = 20, replays: int = 20) -> float:
    """Microseconds per fn() inside a CUDA graph (launch overhead as in the decode steps)."""
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
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / (calls * replays) * 1e3


def gemm_times(shape: str, device) -> dict:
    """One layer's GEMMs (qkv, o, gate_up, down) at M = 1, 4, 16 inside CUDA graphs, with the
    compiled elementwise kernels: bf16 F.linear; fp8_linear; and its parts (the activation
    quantization, the unscaled _scaled_mm, the rescale). Microseconds."""
    if device.type != "cuda":
        return {}
    from runtime.models.arch import fused

    fused.compile_kernels(device)
    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    shapes = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    one = torch.ones((), device=device)
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        w8, scale = quant.quantize_rows(w)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x8, xs = fused.fp8_quantize_rows(x)
            y = torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            ref = F.linear(x.float(), quant.dequantize(w8, scale))
            err = (quant.fp8_linear(x, w8, scale).float() - ref).norm() / ref.norm()
            row = {
                "bf16": _graph_time(lambda: F.linear(x, w)),
                "fp8_linear": _graph_time(lambda: quant.fp8_linear(x, w8, scale)),
                "quantize": _graph_time(lambda: fused.fp8_quantize_rows(x)),
                "scaled_mm": _graph_time(
                    lambda: torch._scaled_mm(
                        x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
                    )
                ),
                "scaled_mm_bf16_out": _graph_time(
                    lambda: torch._scaled_mm(
                        x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                    )
                ),
                "rescale": _graph_time(
                    lambda: fused.fp8_rescale(y, xs, scale, None, torch.bfloat16)
                ),
            }
            row["ratio"] = row["fp8_linear"] / row["bf16"]
            row["rel_err_vs_dequantized"] = err.item()
            out[f"{name}_m{m}"] = row
    return out


def fused_times(shape: str, device) -> dict:
    """One layer's elementwise kernels around its FP8 GEMMs at M = 1, 4, 16 in CUDA graphs
    (compiled), microseconds: the unfused sequence (norm, quantize, rescale, silu_mul as
    kernels of their own; RoPE and attention output quantization left out, as in both) vs the
    fused functions that replace it."""
    if device.type != "cuda":
        return {}

    fused.compile_kernels(device)
    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    bf16, eps = torch.bfloat16, 1e-5
    out = {}
    for m in (1, 4, 16):
        x = torch.randn(m, h, device=device, dtype=bf16)
        w = torch.ones(h, device=device, dtype=bf16)
        raw_h = torch.randn(m, h, device=device)
        raw_i = torch.randn(m, 2 * i, device=device)
        xs = torch.rand(m, 1, device=device) * 0.01
        ws_h, ws_i = (torch.rand(n, device=device) * 0.01 for n in (h, 2 * i))

        def unfused():
            d = fused.fp8_rescale(raw_h, xs, ws_h, None, bf16)  # o_proj epilogue
            _, n = fused.add_rms_norm(x, d, w, eps)
            fused.fp8_quantize_rows(n)  # gate_up prologue
            g = fused.fp8_rescale(raw_i, xs, ws_i, None, bf16)  # gate_up epilogue
            fused.fp8_quantize_rows(fused.silu_mul(g))  # down prologue

        def fused_fns():
            fused.add_rms_norm_fp8(x, raw_h, w, eps, xs, ws_h)
            fused.silu_mul_fp8(raw_i, xs, ws_i, None, bf16)

        out[f"m{m}"] = {"unfused": _graph_time(unfused), "fused": _graph_time(fused_fns)}
    return out


def step_times(target: str, device) -> dict:
    out, logits = {}, {}
    for name, quantization, fuse in (
        ("bf16", None, True),
        ("fp8", "fp8", True),
        ("fp8_unfused", "fp8", False),
    ):
        quant.FUSE_FP8 = fuse  # read while tracing and capturing, so for the whole run
        try:
            model = load_model(target, torch.bfloat16, device, quantization=quantization)
            model.allocate_cache(SLOTS, CACHE_LEN)
            runner = StepRunner(model, device, SLOTS, K + 1, cuda_graphs=True)
            ids = torch.tensor([prompts(model.vocab_size)[0]], device=device)
            out[f"{name}_weight_bytes"] = weight_bytes_per_step(model)
            for tokens in (1, K + 1):
                out[f"{name}_{tokens}_token_step_ms"] = 1e3 * step_time(
                    runner, device, 1, tokens, 200, iters=30
                )
            logits[name] = runner.run(ids, [0], [0], [ids.shape[1]])[0].float().clone()
        finally:
            quant.FUSE_FP8 = True
        del model, runner
        torch.cuda.empty_cache() if device.type == "cuda" else None
    out["decode_speedup"] = out["bf16_1_token_step_ms"] / out["fp8_1_token_step_ms"]
    out["decode_speedup_unfused"] = out["bf16_1_token_step_ms"] / out["fp8_unfused_1_token_step_ms"]
    a, b = logits["fp8"], logits["fp8_unfused"]
    out["compiled_fused_vs_unfused_max_abs_logit_diff"] = (a - b).abs().max().item()
    out["compiled_fused_vs_unfused_top1_agreement"] = (
        (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    )
    return out


def fit_70b(tmp: str, device) -> dict:
    """70b target + 8b draft, both FP8 on `device`: memory and KV room."""
    from runtime.models.runners.kv_budget import cache_bytes, device_memory

    _, target = build_pair(f"{tmp}/70b", "70b", 2, 0.02, 0, torch.bfloat16, materialize=False)
    _, draft = build_pair(f"{tmp}/8b", "8b", 2, 0.0, 1, torch.bfloat16, materialize=False)
    t0 = time.time()  # the 8b pair's target (all 32 layers) is the 70b target's draft
    models = [load_model(p, torch.bfloat16, device, quantization="fp8") for p in (target, draft)]
    load_s = time.time() - t0
    free, total = device_memory(device)
    per_slot = sum(cache_bytes(m, 1, 4096) for m in models)
    return {
        "load_s": load_s,
        "weights_gib": [weight_bytes_per_step(m) / GIB for m in models],
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "free_gib": free / GIB,
        "total_gib": total / GIB,
        "kv_slots_of_4096_that_fit": int(0.9 * free // per_slot),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--fit", action="store_true", help="also the 70b + 8b fit on one GPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the workers do
    report = {"shape": args.shape, "device": str(device)}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        _, t32 = build_pair(f"{tmp}/f32", args.shape, 2, 0.02, 0, torch.float32, materialize=False)
        report["exactness_float32"] = exactness(t32, device, args.steps)
        if device.type == "cuda":
            _, t16 = build_pair(
                f"{tmp}/bf16", args.shape, 2, 0.02, 0, torch.bfloat16, materialize=False
            )
            report["fp8_gemm_vs_weight_only"] = gemm_paths(t16, device)
            report["gemm_us"] = gemm_times(args.shape, device)
            report["fused_elementwise_us"] = fused_times(args.shape, device)
            report["step_times"] = step_times(t16, device)
            if args.fit:
                report["fit_70b_with_8b_draft"] = fit_70b(tmp, device)
    report["wall_s"] = time.time() - t0
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if report["exactness_float32"]["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
