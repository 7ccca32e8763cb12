"""Microbenchmark of the Triton decode/verify attention (runtime/models/kernels/attention.py)
against the eager path it replaces (runtime.models.arch.attention.grouped_attention over the cache
views, with the mask built per step), on the decode shapes of the synthetic models; and, for
the FP8 path, the plain kernel followed by fused.fp8_quantize_rows of its output against the
kernel's fused variant (slot_attention(..., quantize=True): combine and per-token
quantization in one launch).

Each call is replayed from a CUDA graph of 20 calls, so launch gaps are not counted. Achieved
bandwidth = KV bytes attended / time, against the measured copy bandwidth. Also checks that
the kernel's output equals the eager one (bf16: max abs diff; float32: < 1e-4), and counts
the e4m3 values where the two FP8 paths differ. The cache holds 4096 + 16 positions: the
chunks past a row's length are dead (no program work, no partial traffic), so short rows pay
for their length, not for the cache's.

    python lab/gpu/kernel_bench.py --out kernels.json
    python lab/gpu/kernel_bench.py --chunks 256,128,64   # the kernel's KV chunk length
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.bench.metrics import copy_bandwidth
from runtime.models.arch import fused
from runtime.models.arch.attention import grouped_attention
from runtime.models.arch.cache import ExtendBatch, KVCache, blocks_for
from runtime.models.arch.elementwise import stack_heads
from runtime.models.arch.fp8_elementwise import fp8_quantize_rows
from runtime.models.kernels import attention as kernel_module
from runtime.models.kernels.attention import slot_attention

SHAPES = {"8b": (32, 8, 128), "70b-tp1": (64, 8, 128), "1b": (32, 8, 64)}  # H, Hkv, D
REPEAT = 20
BLOCK_SIZE = 16  # runtime.kv_block_size's default


def graphed_us(fn) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph of REPEAT calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * REPEAT)


def setup(
    shape: str, batch: int, seq: int, kv_len: int, dtype: torch.dtype, cache_len: int
) -> tuple:
    """A random block pool and the step's tensors: (cache, q [B, Hkv, r*T, D], block tables
    [B, M] (each row's blocks in order), start, n_valid, positions, valid), rows of kv_len
    positions whose last seq are the new tokens."""
    n_heads, n_kv, dim = SHAPES[shape]
    dev = torch.device("cuda")
    per_row = blocks_for(cache_len, BLOCK_SIZE)
    cache = KVCache(max(batch, 1) * per_row, BLOCK_SIZE, n_kv, dim, dtype, dev)
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    slots = torch.arange(batch * per_row, device=dev, dtype=torch.int32).view(batch, per_row)
    start = torch.full((batch,), kv_len - seq, device=dev)
    n_valid = torch.full((batch,), seq, device=dev)
    q = stack_heads(torch.randn(batch, seq, n_heads, dim, device=dev, dtype=dtype), n_kv)
    positions = start[:, None] + torch.arange(seq, device=dev)[None, :]
    valid = torch.ones(batch, seq, dtype=torch.bool, device=dev)
    return cache, q, slots, start, n_valid, positions, valid


def case(shape: str, batch: int, seq: int, kv_len: int, dtype: torch.dtype, cache_len: int) -> dict:
    cache, q, slots, start, n_valid, positions, valid = setup(
        shape, batch, seq, kv_len, dtype, cache_len
    )
    n_kv, dim = q.shape[1], q.shape[3]
    bucket = 256
    while bucket < kv_len:
        bucket *= 2  # the eager path attends over a KV bucket

    def eager():
        batch_ = ExtendBatch.build(
            slots, start, n_valid, seq, min(bucket, cache_len), BLOCK_SIZE, cache.scratch
        )
        k_all, v_all = cache.read(batch_)
        return grouped_attention(q, k_all, v_all, batch_.mask(), seq)

    def kernel():
        return slot_attention(q, cache.k_cache, cache.v_cache, slots, positions, valid, seq)

    diff = (kernel().float() - eager().float()).abs().max().item()
    eager_us, kernel_us = graphed_us(eager), graphed_us(kernel)
    kv_bytes = 2 * batch * n_kv * kv_len * dim * cache.k_cache.element_size()
    return {
        "shape": shape,
        "batch": batch,
        "tokens": seq,
        "kv_len": kv_len,
        "dtype": str(dtype).split(".")[-1],
        "eager_us": round(eager_us, 1),
        "kernel_us": round(kernel_us, 1),
        "speedup": round(eager_us / kernel_us, 2),
        "kernel_GBps": round(kv_bytes / kernel_us / 1e3, 1),
        "max_abs_diff": diff,
    }


def fp8_case(shape: str, batch: int, seq: int, kv_len: int, cache_len: int) -> dict:
    """The FP8 path's attention (bf16): the kernel then per-token quantization of its output
    [B*T, H*D], eager fp8_quantize_rows or the model's torch.compile'd fused.fp8_quantize_heads
    (fused.compile_kernels), against quantize=True (one launch fewer than compiled)."""
    cache, q, slots, _, _, positions, valid = setup(
        shape, batch, seq, kv_len, torch.bfloat16, cache_len
    )
    args = (q, cache.k_cache, cache.v_cache, slots, positions, valid, seq)

    def eager_quantize():
        return fp8_quantize_rows(slot_attention(*args).reshape(batch * seq, -1))

    def compiled_quantize():
        return fused.fp8_quantize_heads(slot_attention(*args))

    def fused_kernel():
        return slot_attention(*args, quantize=True)

    (want, want_scale), (got, got_scale) = eager_quantize(), fused_kernel()
    differ = (got.float() != want.float()).sum().item()
    scale_rel = ((got_scale - want_scale).abs() / want_scale).max().item()
    eager_us, compiled_us, fused_us = (
        graphed_us(fn) for fn in (eager_quantize, compiled_quantize, fused_kernel)
    )
    return {
        "shape": shape,
        "batch": batch,
        "tokens": seq,
        "kv_len": kv_len,
        "eager_quantize_us": round(eager_us, 1),
        "compiled_quantize_us": round(compiled_us, 1),
        "fused_us": round(fused_us, 1),
        "e4m3_differ": differ,
        "e4m3_total": got.numel(),
        "scale_max_rel_diff": scale_rel,
    }


def print_fp8(rows: list[dict], compiled: bool) -> None:
    quantize = "compiled" if compiled else "eager (torch.compile failed)"
    print(
        "\nFP8 output (bf16): kernel + fp8_quantize_rows (eager) or fp8_quantize_heads "
        f"({quantize}) vs quantize=True"
    )
    print(
        "| chunk | shape | batch | tokens | kv_len | + eager quantize us | "
        "+ compiled quantize us | quantize=True us | e4m3 differ | scale max rel diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['chunk']} | {r['shape']} | {r['batch']} | {r['tokens']} | {r['kv_len']} | "
            f"{r['eager_quantize_us']} | {r['compiled_quantize_us']} | {r['fused_us']} | "
            f"{r['e4m3_differ']} / {r['e4m3_total']} | {r['scale_max_rel_diff']:.1e} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--chunks",
        default="0",
        help="comma-separated KV chunk lengths of the kernel to compare "
        "(0: the kernel's own choice by batch)",
    )
    args = ap.parse_args()
    copy = copy_bandwidth(torch.device("cuda"))
    chunks = [int(c) for c in args.chunks.split(",")]
    rows, fp8_rows, exact = [], [], True
    for chunk in chunks:
        kernel_module.CHUNK = chunk  # chunk_len reads it at call time
        for shape in ("8b", "1b"):
            for batch, seq in ((1, 1), (1, 5), (16, 1), (16, 5)):
                for kv_len in (256, 1024, 4096):
                    rows.append(
                        dict(
                            case(shape, batch, seq, kv_len, torch.bfloat16, 4096 + 16), chunk=chunk
                        )
                    )
        rows.append(dict(case("8b", 2, 5, 700, torch.float32, 1024), chunk=chunk))
        exact = exact and rows[-1]["max_abs_diff"] < 1e-4
    # after the eager rows: compile_kernels also swaps the eager path's masked_softmax
    compiled = fused.compile_kernels(torch.device("cuda"))  # the model's fp8_quantize_heads
    for chunk in chunks:
        kernel_module.CHUNK = chunk
        for shape in ("8b", "70b-tp1"):
            for batch, seq in ((1, 1), (1, 5), (16, 1), (16, 5)):
                for kv_len in (256, 1024, 4096):
                    fp8_rows.append(
                        dict(fp8_case(shape, batch, seq, kv_len, 4096 + 16), chunk=chunk)
                    )
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; float32 equal to eager: {exact}")
    print(
        "| chunk | shape | batch | tokens | kv_len | eager us | kernel us | speedup | kernel GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['chunk']} | {r['shape']} | {r['batch']} | {r['tokens']} | {r['kv_len']} | "
            f"{r['eager_us']} | {r['kernel_us']} | {r['speedup']} | {r['kernel_GBps']} |"
        )
    print_fp8(fp8_rows, compiled)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "copy_GBps": copy / 1e9,
                    "float32_exact": exact,
                    "rows": rows,
                    "fp8_rows": fp8_rows,
                },
                f,
                indent=1,
            )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
