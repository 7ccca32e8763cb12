"""Microbenchmark of the prefill flash-attention kernel (runtime/models/kernels/
prefill_attention.py, issue 36) against the two torch paths a long prompt's chunks can take.

A prompt of P tokens is prefilled in chunks of C tokens (one row); each chunk attends over
the row's whole cache so far (its own K/V already written). Per layer, summed over the
prompt's chunks (each chunk's time the median of --reps calls after --warmup, CUDA events,
L2 flushed before each call):
  kernel     prefill_attention over the paged cache (no gather, no mask)
  sdpa       KVCache.read (the gather) + F.scaled_dot_product_attention, flash backend,
             attn_mask=causal_lower_right(T, L), enable_gqa=True (expanded K/V where refused)
  sdpa_attn  the same SDPA call alone, over K/V gathered beforehand (a flash floor, no gather)
  eager      KVCache.read + grouped_attention with the explicit mask (today's path; the mask
             is built once per call for all layers, so outside the timing)
TFLOP/s counts causal FLOPs: 4 * D * H * sum over queries of attended positions. The
kernel's output is checked against sdpa's (max abs diff, relative L2) on every chunk, and
--check first runs ragged / windowed / FP8 / float32 cases against grouped_attention.

    python lab/gpu/prefill_attention_bench.py --check --out prefill.json
    python lab/gpu/prefill_attention_bench.py --methods kernel --configs 128x64x8x3,128x128x8x3
    TRITON_INTERPRET=1 python lab/gpu/prefill_attention_bench.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64), "d256": (16, 8, 256)}  # H, Hkv, D
METHODS = ("kernel", "sdpa", "sdpa_attn", "eager")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, interpreter)")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", default="2048,8192,32768")
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--configs",
        default="",
        help="kernel tunables to compare, BLOCK_MxBLOCK_NxWARPSxSTAGES,... (default: the module's)",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="the correctness cases first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.chunks, args.reps, args.warmup = "64", "32,64", 1, 0
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    return args


ARGS = parse()
import triton  # noqa: E402

from runtime.models.arch import fp8_elementwise  # noqa: E402
from runtime.models.arch.attention import grouped_attention  # noqa: E402
from runtime.models.arch.cache import ExtendBatch, KVCache, blocks_for  # noqa: E402
from runtime.models.arch.elementwise import stack_heads  # noqa: E402
from runtime.models.kernels import prefill_attention as kernel  # noqa: E402

DEV = torch.device(ARGS.device)
CUDA = DEV.type == "cuda"
SDPA_KERNELS: list[str] = []  # what the sdpa call launched, read once
FLUSH = torch.empty(256 << 20, dtype=torch.int8, device=DEV) if CUDA else None


def timed_ms(fn) -> float:
    """Median milliseconds of fn over ARGS.reps calls after ARGS.warmup (L2 flushed first)."""
    for _ in range(ARGS.warmup):
        fn()
    times = []
    for _ in range(ARGS.reps):
        if CUDA:
            FLUSH.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def pool(
    positions: int,
    n_kv: int,
    dim: int,
    dtype: torch.dtype,
    block_size: int,
    rows: int = 1,
    fp8: bool = False,
) -> tuple[KVCache, torch.Tensor]:
    """A random pool for `rows` rows of `positions` and their tables [rows, M] int32, the
    blocks in a shuffled order (as a block manager hands them out)."""
    m = blocks_for(positions, block_size)
    cache = KVCache(rows * m, block_size, n_kv, dim, dtype, DEV, "fp8" if fp8 else "auto")
    if fp8:
        for data, scale in ((cache.k_cache, cache.k_scale), (cache.v_cache, cache.v_scale)):
            d, s = fp8_elementwise.fp8_quantize_kv(torch.randn(*data.shape, device=DEV) * 2)
            data.copy_(d)
            scale.copy_(s)
    else:
        cache.k_cache.normal_()
        cache.v_cache.normal_()
    perm = torch.randperm(rows * m, device=DEV).to(torch.int32)
    return cache, perm.view(rows, m)


def batch_of(cache: KVCache, table: torch.Tensor, starts, n_valid, seq: int) -> ExtendBatch:
    return ExtendBatch.build(
        table,
        torch.tensor(starts, device=DEV),
        torch.tensor(n_valid, device=DEV),
        seq,
        max(s + n for s, n in zip(starts, n_valid)),
        cache.block_size,
        cache.scratch,
    )


def reference(q, cache, batch, window, seq):
    """grouped_attention in float32 over the rows dequantized in float32."""
    dtype, cache.dtype = cache.dtype, torch.float32
    k, v = cache.read(batch)
    cache.dtype = dtype
    return grouped_attention(q.float(), k.float(), v.float(), batch.mask(window), seq)


def check_cases() -> list[dict]:
    """The kernel against grouped_attention on ragged rows (padding queries, an empty row),
    a window, r = 1 / 4, float32 / bf16 / FP8 caches, head_dim 64 / 128 / 96 / 256."""
    out = []
    for dtype, dim, fp8, window, n_heads, n_kv in (
        (torch.float32, 128, False, None, 32, 8),
        (torch.bfloat16, 128, False, None, 32, 8),
        (torch.bfloat16, 128, False, 300, 8, 8),
        (torch.bfloat16, 64, False, None, 32, 8),
        (torch.bfloat16, 128, True, None, 32, 8),
        (torch.float16, 96, False, 1000, 8, 2),
        (torch.bfloat16, 256, False, None, 8, 2),
        (torch.float32, 256, False, 500, 8, 2),
        (torch.float32, 64, True, None, 32, 8),
    ):
        starts, n_valid, seq = [0, 700, 1500, 333], [900, 517, 64, 0], 900
        cache, table = pool(2600, n_kv, dim, dtype, ARGS.block_size, rows=4, fp8=fp8)
        batch = batch_of(cache, table, starts, n_valid, seq)
        q = stack_heads(torch.randn(4, seq, n_heads, dim, device=DEV), n_kv).to(dtype)
        case = {
            "dtype": str(dtype).split(".")[-1],
            "head_dim": dim,
            "fp8": fp8,
            "window": window,
            "r": n_heads // n_kv,
        }
        try:
            got = kernel.prefill_attention(
                q, cache.k_cache, cache.v_cache, table, *batch.int32_rows(), window, cache.scales
            )
        except triton.runtime.errors.OutOfResources as e:
            out.append(dict(case, error=str(e), ok=False))
            continue
        want = reference(q, cache, batch, window, seq)
        ok = batch.valid
        rel = ((got[ok].float() - want[ok]).norm() / want[ok].norm()).item()
        pad_zero = bool(torch.all(got[~ok] == 0)) and bool(torch.isfinite(got).all())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        out.append(dict(case, rel_l2=rel, padding_zero=pad_zero, ok=rel < tol and pad_zero))
    return out


def sdpa_call(q4, k, v, causal_bias, gqa):
    """[B, H, T, D] SDPA (flash backend on CUDA); gqa False: K/V expanded to H heads."""
    if not gqa:
        rep = q4.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(
        q4, k, v, attn_mask=causal_bias, **({"enable_gqa": True} if gqa else {})
    )


def sdpa_context():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION] if CUDA else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    )


def kernel_names(fn) -> list[str]:
    """The device kernels one call of fn launches (which SDPA backend ran)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if CUDA else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        if CUDA:
            torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    return sorted(
        n for n in names if any(w in n.lower() for w in ("flash", "fmha", "attention", "efficient"))
    )[:6]


def prompt_case(
    prompt: int,
    chunk: int,
    n_heads: int,
    n_kv: int,
    dim: int,
    dtype,
    methods: list[str],
    gqa: list[bool],
) -> dict:
    """One prompt prefilled in chunks: each method's per-layer time over all its chunks."""
    from torch.nn.attention.bias import causal_lower_right

    cache, table = pool(prompt, n_kv, dim, dtype, ARGS.block_size)
    ms = dict.fromkeys(methods, 0.0)
    flops, max_diff, rel = 0, 0.0, 0.0
    for start in range(0, prompt, chunk):
        seq = min(chunk, prompt - start)
        batch = batch_of(cache, table, [start], [seq], seq)
        length = start + seq
        q = stack_heads(torch.randn(1, seq, n_heads, dim, device=DEV, dtype=dtype), n_kv)
        q4 = q.view(1, n_heads, seq, dim)  # stacked rows = head-major
        bias = causal_lower_right(seq, length)
        rows = batch.int32_rows()
        mask = batch.mask()
        k_all, v_all = cache.read(batch)
        flops += 4 * dim * n_heads * sum(range(start + 1, length + 1))

        def run_kernel():
            return kernel.prefill_attention(q, cache.k_cache, cache.v_cache, table, *rows)

        def run_sdpa_attn():
            with sdpa_context():
                return sdpa_call(q4, k_all, v_all, bias, gqa[0]).permute(0, 2, 1, 3)

        def run_sdpa():
            k, v = cache.read(batch)
            with sdpa_context():
                return sdpa_call(q4, k, v, bias, gqa[0]).permute(0, 2, 1, 3)

        def run_eager():
            k, v = cache.read(batch)
            return grouped_attention(q, k, v, mask, seq)

        try:
            want = run_sdpa_attn()
        except (RuntimeError, TypeError):  # enable_gqa refused: expand K/V
            gqa[0] = False
            want = run_sdpa_attn()
        got = run_kernel()
        if not SDPA_KERNELS:
            SDPA_KERNELS.extend(kernel_names(run_sdpa_attn) or ["?"])
        max_diff = max(max_diff, (got.float() - want.float()).abs().max().item())
        rel = max(rel, ((got.float() - want.float()).norm() / want.float().norm()).item())
        fns = {
            "kernel": run_kernel,
            "sdpa": run_sdpa,
            "sdpa_attn": run_sdpa_attn,
            "eager": run_eager,
        }
        for name in methods:
            ms[name] += timed_ms(fns[name])
        del k_all, v_all, mask
    row = {
        "prompt": prompt,
        "chunk": chunk,
        "dtype": str(dtype).split(".")[-1],
        "gflop": round(flops / 1e9, 1),
        "max_abs_diff": max_diff,
        "rel_l2": rel,
        "config": "x".join(map(str, kernel.config(dim, DEV, kernel.programs(q, seq)))),
    }
    for name in methods:
        row[f"{name}_ms"] = round(ms[name], 4)
        row[f"{name}_tflops"] = float(f"{flops / ms[name] / 1e9:.3g}")
    return row


def main() -> int:
    n_heads, n_kv, dim = (4, 2, 16) if ARGS.smoke else SHAPES[ARGS.shape]
    dtype = torch.float32 if ARGS.smoke else torch.bfloat16
    methods = [m for m in ARGS.methods.split(",") if m]
    torch.manual_seed(0)
    result: dict = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (interpreter)",
        "shape": [n_heads, n_kv, dim],
        "block_size": ARGS.block_size,
        "torch": torch.__version__,
    }
    ok = True
    if ARGS.check:
        result["checks"] = check_cases()
        ok = all(c["ok"] for c in result["checks"])
        for c in result["checks"]:
            print(c)
    configs = [tuple(int(x) for x in c.split("x")) for c in ARGS.configs.split(",") if c]
    rows, gqa = [], [True]
    for cfg in configs or [None]:
        if cfg:  # forced, whatever the grid's size
            kernel.CONFIGS[kernel.block_d(dim)] = kernel.FEW_CONFIGS[kernel.block_d(dim)] = cfg
        for prompt in (int(p) for p in ARGS.prompts.split(",")):
            for chunk in (int(c) for c in ARGS.chunks.split(",")):
                if chunk > prompt:
                    continue
                try:
                    rows.append(prompt_case(prompt, chunk, n_heads, n_kv, dim, dtype, methods, gqa))
                except triton.runtime.errors.OutOfResources as e:
                    print(f"config {cfg}: {e}")
                    break
                print(rows[-1], flush=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = ok and all(r["rel_l2"] < tol for r in rows)
    result.update(rows=rows, sdpa_enable_gqa=gqa[0], sdpa_kernels=SDPA_KERNELS, all_ok=ok)
    print(
        f"\n{result['device']}, H {n_heads} Hkv {n_kv} D {dim} {dtype}, block "
        f"size {ARGS.block_size}; ms per layer for the whole prompt (TFLOP/s); SDPA "
        f"enable_gqa: {gqa[0]} ({', '.join(SDPA_KERNELS)}); checks ok: {ok}"
    )
    print("| config | prompt | chunk | " + " | ".join(methods) + " | kernel vs sdpa |")
    print("|---|---|---|" + "---|" * len(methods) + "---|")
    for r in rows:
        cells = " | ".join(f"{r[m + '_ms']:.3f} ({r[m + '_tflops']})" for m in methods)
        print(f"| {r['config']} | {r['prompt']} | {r['chunk']} | {cells} | {r['rel_l2']:.1e} |")
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
