"""The Triton kernels (runtime/models/kernels/) against their eager references, on small shapes,
under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set before triton loads)."""

from __future__ import annotations

import pytest

from tests.interpreted import start_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r'''
import torch
from runtime.models.arch.attention import grouped_attention
from runtime.models.arch.cache import ExtendBatch, KVCache
from runtime.models.arch import fused
from runtime.models.arch.elementwise import stack_heads
from runtime.models.kernels import available, rope
from runtime.models.kernels.attention import slot_attention
from runtime.models.arch.rope import RotaryEmbedding, compute_inv_freq
from tests import paged

assert available(torch.device("cpu"))
torch.manual_seed(0)


def case(starts, n_valid, seq, n_heads, n_kv, dim, cache_len, window, slots, block_size=16):
    """Eager grouped_attention over the gathered rows vs the kernel, every valid query; the
    same K and V in shuffled blocks (rows' blocks interleaved) give the same bits."""
    bsz = len(starts)
    cache, tables = paged.pool(8, cache_len, n_kv, dim, torch.float32, block_size)
    table = tables[torch.tensor(slots)]
    batch = paged.batch(cache, table, starts, n_valid, seq)
    q = stack_heads(torch.randn(bsz, seq, n_heads, dim), n_kv)            # [B, Hkv, r*T, D]
    k_all, v_all = cache.read(batch)
    want = grouped_attention(q, k_all, v_all, batch.mask(window), seq)     # [B, T, H, D]
    got = slot_attention(q, cache.k_cache, cache.v_cache, table, batch.positions,
                         batch.valid, seq, window)
    again = slot_attention(q, cache.k_cache, cache.v_cache, table, *batch.int32_rows(),
                           seq, window)
    assert torch.equal(again, got)         # int32 rows (converted once per call): the same
    ok = batch.valid
    err = (got[ok] - want[ok]).abs().max().item()
    assert err < 1e-4, (starts, n_valid, seq, err)
    assert torch.all(got[~ok] == 0)
    mixed, mixed_tables = paged.shuffled(cache, tables)
    mixed_table = mixed_tables[torch.tensor(slots)]
    assert not torch.equal(mixed_table, table)
    assert torch.equal(slot_attention(q, mixed.k_cache, mixed.v_cache, mixed_table,
                                      *batch.int32_rows(), seq, window), got)
    k_mixed, _ = mixed.read(paged.batch(mixed, mixed_table, starts, n_valid, seq))
    assert torch.equal(k_mixed, k_all)     # the eager gather too


# decode (T=1), ragged lengths, grouped heads (r = 2), slots out of order
case([5, 0, 17], [1, 1, 1], 1, 4, 2, 16, 64, None, [3, 0, 6])
# verify (T=5), a padding row and ragged valid lengths
case([9, 30, 2], [5, 3, 0], 5, 4, 2, 16, 64, None, [1, 2, 5])
# lengths spanning several chunks (chunk = 256) and multi-query heads (r = 4), D = 32
case([300, 600], [4, 2], 4, 8, 2, 32, 1024, None, [0, 1])
# a sliding window, head_dim not a power of two
case([40, 10], [3, 3], 3, 2, 1, 24, 128, 8, [2, 4])
# blocks of 5 positions (not dividing the 100 of a row) and of 1; lengths over several blocks
case([37, 90, 3], [4, 2, 4], 4, 4, 2, 16, 100, None, [1, 6, 3], block_size=5)
case([9, 30], [3, 1], 3, 4, 2, 16, 40, None, [0, 2], block_size=1)


def rope_case(bsz, seq, n_heads, n_kv, dim, dtype):
    """fused.rotary_write (eager) vs the kernel: q, k, v strided slices of one qkv output,
    the returned stacked q and both caches, padding tokens written to scratch."""
    class Cfg:
        rope_theta, rope_scaling, max_position_embeddings = 10000.0, None, 256
    qkv = torch.randn(bsz, seq, (n_heads + 2 * n_kv) * dim).to(dtype)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    q, k, v = (t.view(bsz, seq, -1, dim) for t in (q, k, v))
    caches = [paged.pool(bsz, 64, n_kv, dim, dtype, 8, random=False)[0] for _ in range(2)]
    tables = paged.shuffled(*paged.pool(bsz, 64, n_kv, dim, dtype, 8, random=False))[1]
    batch = paged.batch(caches[0], tables.flip(0), torch.randint(0, 40, (bsz,)).tolist(),
                        [seq] + [max(seq - 1, 0)] * (bsz - 1), seq, 64)
    cos, sin = RotaryEmbedding(compute_inv_freq(Cfg, dim)[0])(batch.positions, dtype)
    args = (batch.write_blocks, batch.write_offsets)
    want = fused.rotary_write(q, k, v, cos, sin, caches[0].k_cache, caches[0].v_cache, *args)
    assert rope.fits(q, k, v, cos, sin)
    got = rope.rotary_write(q, k, v, cos, sin, caches[1].k_cache, caches[1].v_cache, *args)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in ((got, want), (caches[1].k_cache, caches[0].k_cache),
                 (caches[1].v_cache, caches[0].v_cache)):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= tol


def rope_fp8_case(bsz, seq, n_heads, n_kv, dim, dtype, bias):
    """fused.rotary_write_fp8 (eager) vs the kernel: the raw qkv GEMM output rescaled per
    token and channel (+ bias) in the kernel, then as rope_case."""
    n = (n_heads + 2 * n_kv) * dim
    raw = torch.randn(bsz * seq, n) * 300
    scales = (torch.rand(bsz * seq, 1) * 0.01 + 1e-3, torch.rand(n) * 0.01 + 1e-3,
              (torch.randn(n) * 0.5).to(dtype) if bias else None)
    caches = [paged.pool(bsz, 64, n_kv, dim, dtype, random=False) for _ in range(2)]
    tables = caches[0][1]
    caches = [c for c, _ in caches]
    batch = paged.batch(caches[0], tables, torch.randint(0, 40, (bsz,)).tolist(),
                        [seq] + [max(seq - 1, 0)] * (bsz - 1), seq, 64)
    angle = torch.rand(bsz, seq, dim) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    args = (n_heads, n_kv, cos, sin)
    rows = (batch.write_blocks, batch.write_offsets)
    want = fused.rotary_write_fp8(raw, *scales, dtype, *args, caches[0].k_cache,
                                  caches[0].v_cache, *rows)
    assert rope.fits_fp8(raw, *scales, dim, cos, sin)
    got = rope.rotary_write_fp8(raw, *scales, dtype, *args, caches[1].k_cache,
                                caches[1].v_cache, *rows)
    tol = 0 if dtype == torch.float32 else 1e-2
    for a, b in ((got, want), (caches[1].k_cache, caches[0].k_cache),
                 (caches[1].v_cache, caches[0].v_cache)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).abs().max().item() <= tol * max(1, b.abs().max()), dtype
    assert caches[1].v_cache.abs().sum() > 0


rope_case(1, 1, 4, 2, 16, torch.float32)      # decode
rope_case(3, 5, 8, 2, 32, torch.float32)      # verify, ragged (padding to scratch), r = 4
rope_case(2, 3, 4, 4, 16, torch.float16)
assert not rope.fits(*(torch.zeros(1, 1, 2, 24),) * 5)   # head_dim 24: the torch path
rope_fp8_case(1, 1, 4, 2, 16, torch.float32, False)
rope_fp8_case(3, 5, 8, 2, 32, torch.float32, True)     # verify, ragged, q/k/v bias
rope_fp8_case(2, 3, 4, 4, 16, torch.float16, True)
raw = torch.zeros(6, 128)
cos6 = torch.zeros(2, 3, 16)
assert not rope.fits_fp8(raw, torch.zeros(6, 1), torch.zeros(64), None, 16, cos6, cos6)
assert not rope.fits_fp8(raw[:, :64], torch.zeros(6, 1), torch.zeros(64), None, 16, cos6, cos6)
one = torch.zeros(3, 1, 128).split([64, 32, 32], dim=-1)        # a decode step at batch 3:
assert rope.fits(*(t.view(3, 1, -1, 16) for t in one), cos6[:, :1], cos6[:, :1])  # size-1 T


def fold_case(starts, n_valid, seq, n_heads, n_kv, dim, cache_len, dtype, raw, quantize=False,
              bias=False, window=None, block_size=16, shuffle=False):
    """slot_attention of the step's NewTokens (RoPE and the KV write in its partial kernel)
    against rope.rotary_write(_fp8) then slot_attention: bit for bit, outputs and caches."""
    bsz = len(starts)
    caches = [paged.pool(4, cache_len, n_kv, dim, dtype, block_size) for _ in range(2)]
    if shuffle:
        caches = [paged.shuffled(*caches[0]) for _ in range(2)]
    tables = caches[0][1]
    caches = [c for c, _ in caches]
    caches[1].k_cache.copy_(caches[0].k_cache)
    caches[1].v_cache.copy_(caches[0].v_cache)
    slots = tables[torch.tensor([3, 0, 2][:bsz])]
    batch = paged.batch(caches[0], slots, starts, n_valid, seq)
    angle = torch.rand(bsz, seq, dim) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    n = (n_heads + 2 * n_kv) * dim
    writes = (batch.write_blocks, batch.write_offsets)
    if raw:
        out = torch.randn(bsz * seq, n) * 300
        scales = (torch.rand(bsz * seq, 1) * 0.01 + 1e-3, torch.rand(n) * 0.01 + 1e-3,
                  (torch.randn(n) * 0.5).to(dtype) if bias else None)
        args = (out, *scales, dtype, n_heads, n_kv, cos, sin)
        q = rope.rotary_write_fp8(*args, caches[0].k_cache, caches[0].v_cache, *writes)
        new = rope.new_tokens_fp8(*args)
    else:
        qkv = torch.randn(bsz, seq, n).to(dtype)
        parts = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
        parts = [t.view(bsz, seq, -1, dim) for t in parts]
        q = rope.rotary_write(*parts, cos, sin, caches[0].k_cache, caches[0].v_cache, *writes)
        new = rope.new_tokens(*parts, cos, sin)
    rows = batch.int32_rows()
    want = slot_attention(q, caches[0].k_cache, caches[0].v_cache, slots, *rows, seq, window,
                          quantize=quantize)
    got = slot_attention(new, caches[1].k_cache, caches[1].v_cache, slots, *rows, seq, window,
                         quantize=quantize)
    if quantize:
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got[batch.valid], want[batch.valid])
    # the scratch block (last) is not written by the folded kernel
    for a, b in ((caches[1].k_cache, caches[0].k_cache), (caches[1].v_cache, caches[0].v_cache)):
        assert torch.equal(a[:-1], b[:-1]), (starts, dtype, raw)


fold_case([5, 0, 17], [1, 1, 1], 1, 4, 2, 16, 64, torch.float32, False)        # decode
fold_case([9, 30, 2], [5, 3, 0], 5, 4, 2, 16, 64, torch.float32, False)        # a padding row
fold_case([60, 1], [5, 3], 5, 8, 2, 32, 256, torch.float16, False)   # new tokens over 2 chunks
fold_case([60, 1, 7], [5, 3, 0], 5, 8, 2, 32, 256, torch.float32, True, bias=True)   # raw FP8
fold_case([60, 1], [5, 3], 5, 8, 2, 32, 256, torch.bfloat16, True, quantize=True)
fold_case([40, 10], [3, 3], 3, 4, 2, 16, 128, torch.float32, False, window=8)   # sliding window
fold_case([124, 3], [9, 6], 9, 4, 1, 16, 256, torch.float32, True)   # 9 tokens over chunk 1 | 2
# shuffled blocks of 5 positions (not dividing the rows' 100): new tokens across blocks
fold_case([58, 8, 2], [5, 4, 0], 5, 4, 2, 16, 100, torch.float32, False, block_size=5,
          shuffle=True)
print("ok")
'''


def test_slot_attention_equals_grouped_attention(scripts):
    scripts["cases"].check()


QUANTIZATIONS = [None, "fp8"]

MODEL_CASE = r"""
import sys
import torch
from runtime.models import load_model
from runtime.models.arch import quant
from runtime.models import kernels
from runtime.models.kernels import attention as attention_kernel, rope
from tests.interpreted import count_calls

path, quantization = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
# fixed prompts: with FP8 weights an activation that the two paths' float32 roundings put on
# either side of an e4m3 rounding boundary moves the logits by an e4m3 step or more, so
# unseeded prompts failed now and then (once in CI; 5 of 200 seeds, the fold on or off alike)
torch.manual_seed(0)
quant.EMULATE_FP8_GEMM = quantization == "fp8"   # the fused FP8 GEMM path, emulated on CPU
eager, fast, mixed = (load_model(path, torch.float32, "cpu", quantization=quantization)
                      for _ in range(3))
if quantization:
    x = torch.zeros(1, 1, fast.args.hidden_size)
    assert all(layer.self_attn.fp8_fused(x) for layer in fast.model.layers)
for model in (eager, fast):
    model.allocate_cache(4, 64)
mixed.allocate_cache(4, 64, block_size=8)   # blocks of 8 in a shuffled order, rows interleaved
prompts = torch.randint(0, 96, (3, 12))
slots, zeros = torch.tensor([2, 0, 3]), torch.zeros(3, dtype=torch.long)
tables = torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3], [12, 13, 14, 15]], dtype=torch.int32)
mixed_tables = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:24]
mixed_tables = mixed_tables.view(3, 8).to(torch.int32)
steps = [(prompts, zeros, torch.tensor([12, 7, 10])),          # prefill, ragged
         (torch.randint(0, 96, (3, 5)), torch.tensor([12, 7, 10]), torch.tensor([5, 3, 1])),
         (torch.randint(0, 96, (3, 1)), torch.tensor([17, 10, 11]), torch.tensor([1, 1, 1]))]
calls = count_calls(rope, ("rotary_write", "rotary_write_fp8"))   # the RoPE kernel's launches
for ids, start, n in steps:
    kernels.disable()
    want = eager.forward_static(ids, tables, start, n, kv_len=64)
    assert kernels.enable(torch.device("cpu"))
    ok = torch.arange(ids.shape[1])[None, :] < n[:, None]
    for fold in (True, False):          # RoPE in the attention kernel, then separate
        attention_kernel.FOLD_ROPE_MIN_SEQ = 2 if fold else 1 << 30
        del calls[:]
        got = fast.forward_static(ids, tables, start, n, kv_len=64)
        folds = fold and ids.shape[1] >= 2                 # not decode
        assert len(calls) == (0 if folds else fast.args.n_layers), (fold, len(calls))
        err = (got[ok] - want[ok]).abs().max().item()
        assert err < 1e-4, err
        if fold:                        # the same step through shuffled tables: the same bits
            paged_got = mixed.forward_static(ids, mixed_tables, start, n, kv_len=64)
            assert torch.equal(paged_got[ok], got[ok])
print("ok")
"""


@pytest.fixture(scope="module")
def scripts(llama_path):
    """This file's interpreted scripts, started at once (each is one busy core's work) and
    checked by their tests."""
    started = {"cases": start_interpreted(CASES)}
    for quantization in QUANTIZATIONS:
        started[quantization] = start_interpreted(
            MODEL_CASE, llama_path, *([quantization] if quantization else [])
        )
    yield started
    for script in started.values():
        script.kill()


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_model_steps_through_the_kernels_equal_eager(scripts, quantization):
    """forward_static with the kernels on (interpreted) equals the eager path: prefill rows
    and a ragged verify step of a whole model, the kernels reading the cache in place; with
    FP8 weights on the fused FP8 GEMM path (emulated) too: the qkv rescale in the RoPE
    kernel, the output quantized in the attention kernel's combine. Each step twice: RoPE
    and the KV write folded into the attention kernel (no RoPE launch; a 1-token decode
    step keeps the RoPE kernel), then apart."""
    scripts[quantization].check()
