"""Microbenchmark of RoPE folded into the attention kernel: the RoPE / KV-write kernel then
slot_attention over the stacked queries (runtime/models/kernels/rope.py, attention.py)
against slot_attention of the step's NewTokens, which rotates the queries and writes the new
keys and values in its partial kernel (one launch fewer). bf16 activations, or the fused FP8
path's raw float32 qkv output with its scales (--fp8); the 8b shape (32 query heads, 8 KV
heads, head_dim 128) over a cache of 4096 + 16 positions.

Each call is replayed from a CUDA graph of calls (lab/gpu/kernel_bench.graphed_us), so
launch gaps are not counted; the two forms' outputs and caches are compared bit for bit.
The engine folds from kernels.attention.FOLD_ROPE_MIN_SEQ tokens a row on; this shows the
kernels' side of that choice per step length.

    python lab/gpu/fold_bench.py --out fold.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from lab.gpu.kernel_bench import graphed_us
from runtime.models.arch.cache import ExtendBatch, KVCache, blocks_for
from runtime.models.kernels import rope
from runtime.models.kernels.attention import slot_attention

N_HEADS, N_KV, DIM, CACHE = 32, 8, 128, 4096 + 16


def case(
    batch: int,
    seq: int,
    kv_len: int,
    fp8: bool,
    device: torch.device = None,
    timer=None,
    cache_len: int = CACHE,
) -> dict:
    """Times both forms (timer(fn) -> µs; graphed_us on CUDA) for rows of kv_len positions
    whose last seq are the step's tokens, and compares them bit for bit."""
    dev, dtype = device or torch.device("cuda"), torch.bfloat16
    per_row = blocks_for(cache_len, 16)  # blocks of runtime.kv_block_size's 16
    caches = [KVCache(batch * per_row, 16, N_KV, DIM, dtype, dev) for _ in range(2)]
    caches[0].k_cache.normal_()
    caches[0].v_cache.normal_()
    caches[1].k_cache.copy_(caches[0].k_cache)
    caches[1].v_cache.copy_(caches[0].v_cache)
    start = torch.full((batch,), kv_len - seq, device=dev)
    slots = torch.arange(batch * per_row, device=dev, dtype=torch.int32).view(batch, per_row)
    rows = ExtendBatch.build(
        slots, start, torch.full((batch,), seq, device=dev), seq, kv_len, 16, caches[0].scratch
    )
    pos, ok = rows.int32_rows()
    angle = torch.rand(batch, seq, DIM, device=dev) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    n = (N_HEADS + 2 * N_KV) * DIM
    if fp8:
        raw = torch.randn(batch * seq, n, device=dev) * 300
        scales = (
            torch.rand(batch * seq, 1, device=dev) / 100,
            torch.rand(n, device=dev) / 100,
            None,
        )
        args = (raw, *scales, dtype, N_HEADS, N_KV, cos, sin)
        new = rope.new_tokens_fp8(*args)
    else:
        qkv = torch.randn(batch, seq, n, device=dev).to(dtype)
        args = [
            t.view(batch, seq, -1, DIM)
            for t in qkv.split([N_HEADS * DIM, N_KV * DIM, N_KV * DIM], dim=-1)
        ]
        new = rope.new_tokens(*args, cos, sin)

    def separate():
        c = caches[0]
        writes = (c.k_cache, c.v_cache, rows.write_blocks, rows.write_offsets)
        q = (
            rope.rotary_write_fp8(*args, *writes)
            if fp8
            else rope.rotary_write(*args, cos, sin, *writes)
        )
        return slot_attention(q, c.k_cache, c.v_cache, slots, pos, ok, seq, quantize=fp8)

    def folded():
        c = caches[1]
        return slot_attention(new, c.k_cache, c.v_cache, slots, pos, ok, seq, quantize=fp8)

    want, got = separate(), folded()
    if fp8:
        equal = torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    else:
        equal = torch.equal(got, want)
    cells = cache_len  # the scratch position is not written
    equal = equal and all(
        torch.equal(a[:, :, :cells], b[:, :, :cells])
        for a, b in ((caches[0].k_cache, caches[1].k_cache), (caches[0].v_cache, caches[1].v_cache))
    )
    timer = timer or graphed_us
    separate_us, folded_us = timer(separate), timer(folded)
    return {
        "fp8": fp8,
        "batch": batch,
        "tokens": seq,
        "kv_len": kv_len,
        "separate_us": round(separate_us, 1),
        "folded_us": round(folded_us, 1),
        "separate_over_folded": round(separate_us / folded_us, 3) if folded_us else None,
        "equal": equal,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [
        case(batch, seq, kv_len, fp8)
        for fp8 in (False, True)
        for batch in (1, 16)
        for seq in (1, 2, 5, 9)
        for kv_len in (256, 4096)
    ]
    print(
        "| weights | batch | tokens | kv_len | RoPE kernel + attention us | folded us | "
        "separate / folded | equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'FP8' if r['fp8'] else 'bf16'} | {r['batch']} | {r['tokens']} | "
            f"{r['kv_len']} | {r['separate_us']} | {r['folded_us']} | "
            f"{r['separate_over_folded']}x | {r['equal']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
