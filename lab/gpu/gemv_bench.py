"""Microbenchmark of the experimental small-M linear kernel (lab/gpu/gemv_kernel.py)
against the library GEMMs the runtime uses, on one decoder layer's shapes of the synthetic
models:

- bf16 weights: F.linear (cuBLAS) vs the kernel;
- FP8 weights: the _scaled_mm path (per-token quantize, unscaled _scaled_mm, rescale: three
  kernels, as quant.fp8_linear runs it without the kernel) and _scaled_mm alone, vs the kernel
  (weight-only, scales in its epilogue);
- down_proj with SiLU(gate) * up folded into the kernel's loads vs silu_mul + the GEMM.

Each call is replayed from a CUDA graph of 20 calls (kernel_bench.graphed_us). GB/s counts the
weight bytes (+ scales) read, against the measured copy bandwidth. Also checks each kernel's
output against a float32 reference (relative error).

    python lab/gpu/gemv_bench.py --out gemv.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from lab.gpu.gemv_kernel import gemv
from lab.gpu.kernel_bench import graphed_us
from runtime.bench.metrics import copy_bandwidth
from runtime.models.arch import fused, quant
from runtime.models.loading.synthetic import SHAPES


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one decoder layer's fused linears."""
    s = SHAPES[shape]
    h, i, d = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def case(shape: str, name: str, n: int, k: int, m: int) -> dict:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    w = torch.randn(n, k, device=dev) * 0.02
    w16, (w8, scale) = w.to(bf16), quant.quantize_rows(w)
    silu = name == "down"
    x = torch.randn(m, 2 * k if silu else k, device=dev, dtype=bf16)
    act = fused.silu_mul(x) if silu else x  # the GEMM's input
    row = {"shape": shape, "linear": name, "N": n, "K": k, "M": m}
    ref16 = F.linear(act.float(), w16.float())
    ref8 = F.linear(act.float(), quant.dequantize(w8, scale))
    row["bf16_cublas_us"] = graphed_us(lambda: F.linear(act, w16))
    row["bf16_gemv_us"] = graphed_us(lambda: gemv(act, w16))
    row["bf16_gemv_err"] = rel_err(gemv(act, w16), ref16)

    def scaled_mm_path():
        x8, xs = fused.fp8_quantize_rows(act)
        return fused.fp8_rescale(quant.fp8_gemm_raw(x8, w8), xs, scale, None, bf16)

    x8 = fused.fp8_quantize_rows(act)[0]
    row["fp8_scaled_mm_path_us"] = graphed_us(scaled_mm_path)
    row["fp8_scaled_mm_alone_us"] = graphed_us(lambda: quant.fp8_gemm_raw(x8, w8))
    row["fp8_gemv_us"] = graphed_us(lambda: gemv(act, w8, scale))
    row["fp8_gemv_err"] = rel_err(gemv(act, w8, scale), ref8)
    row["fp8_scaled_mm_path_err"] = rel_err(scaled_mm_path(), ref8)
    if silu:  # the SiLU folded in, against silu_mul then the GEMM
        row["bf16_silu_then_cublas_us"] = graphed_us(lambda: F.linear(fused.silu_mul(x), w16))
        row["bf16_gemv_silu_us"] = graphed_us(lambda: gemv(x, w16, silu_mul=True))
        row["fp8_gemv_silu_us"] = graphed_us(lambda: gemv(x, w8, scale, silu_mul=True))
        row["fp8_gemv_silu_err"] = rel_err(gemv(x, w8, scale, silu_mul=True), ref8)
    for kind, nbytes in (("bf16", 2 * n * k), ("fp8", n * k + 4 * n)):
        row[f"{kind}_gemv_GBps"] = round(nbytes / row[f"{kind}_gemv_us"] / 1e3, 1)
    row["bf16_cublas_GBps"] = round(2 * n * k / row["bf16_cublas_us"] / 1e3, 1)
    row["fp8_scaled_mm_alone_GBps"] = round(n * k / row["fp8_scaled_mm_alone_us"] / 1e3, 1)
    return {key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8b,70b")
    ap.add_argument("--m", default="1,2,5,8,16", help="rows (tokens) per call")
    args = ap.parse_args()
    copy = copy_bandwidth(torch.device("cuda"))
    rows = [
        case(shape, name, n, k, m)
        for shape in args.shapes.split(",")
        for name, (n, k) in layer_shapes(shape).items()
        for m in (int(v) for v in args.m.split(","))
    ]
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s")
    print(
        "| shape | linear | M | bf16 cuBLAS us | bf16 gemv us | FP8 _scaled_mm path us | "
        "_scaled_mm alone us | FP8 gemv us | FP8 gemv GB/s | down: silu+GEMM / gemv-silu us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        silu = (
            f"{r['bf16_silu_then_cublas_us']:.1f} / {r['bf16_gemv_silu_us']:.1f} (bf16), "
            f"{r['fp8_gemv_silu_us']:.1f} (fp8)"
            if "fp8_gemv_silu_us" in r
            else ""
        )
        print(
            f"| {r['shape']} | {r['linear']} | {r['M']} | {r['bf16_cublas_us']:.1f} | "
            f"{r['bf16_gemv_us']:.1f} | {r['fp8_scaled_mm_path_us']:.1f} | "
            f"{r['fp8_scaled_mm_alone_us']:.1f} | {r['fp8_gemv_us']:.1f} | "
            f"{r['fp8_gemv_GBps']} | {silu} |"
        )
    worst = max(
        max(r["bf16_gemv_err"], r["fp8_gemv_err"], r.get("fp8_gemv_silu_err", 0)) for r in rows
    )
    print(f"largest relative error of the kernel vs float32: {worst:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_GBps": copy / 1e9, "rows": rows}, f, indent=1)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
