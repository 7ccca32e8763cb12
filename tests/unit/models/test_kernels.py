"""The Triton kernels (runtime/models/arch/kernels/) against their eager references, on small shapes,
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
from runtime.models.arch.fused import stack_heads
from runtime.models.arch.kernels import available, rope
from runtime.models.arch.kernels.attention import slot_attention
from runtime.models.arch.rope import RotaryEmbedding, compute_inv_freq

assert available(torch.device("cpu"))
torch.manual_seed(0)


def case(starts, n_valid, seq, n_heads, n_kv, dim, cache_len, window, slots):
    """Eager grouped_attention over cache views vs the kernel, every valid query."""
    bsz = len(starts)
    cache = KVCache(8, cache_len - 1, n_kv, dim, torch.float32)
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    slots_t = torch.tensor(slots)
    starts_t, valid_t = torch.tensor(starts), torch.tensor(n_valid)
    kv_len = max(s + n for s, n in zip(starts, n_valid))
    batch = ExtendBatch.build(slots_t, starts_t, valid_t, seq, kv_len, cache_len - 1)
    q = stack_heads(torch.randn(bsz, seq, n_heads, dim), n_kv)            # [B, Hkv, r*T, D]
    k_all, v_all = cache.read(batch)
    want = grouped_attention(q, k_all, v_all, batch.mask(window), seq)     # [B, T, H, D]
    got = slot_attention(q, cache.k_cache, cache.v_cache, slots_t, batch.positions,
                         batch.valid, seq, window)
    again = slot_attention(q, cache.k_cache, cache.v_cache, slots_t, *batch.int32_rows(),
                           seq, window)
    assert torch.equal(again, got)         # int32 rows (converted once per call): the same
    ok = batch.valid
    err = (got[ok] - want[ok]).abs().max().item()
    assert err < 1e-4, (starts, n_valid, seq, err)
    assert torch.all(got[~ok] == 0)


# decode (T=1), ragged lengths, grouped heads (r = 2), slots out of order
case([5, 0, 17], [1, 1, 1], 1, 4, 2, 16, 64, None, [3, 0, 6])
# verify (T=5), a padding row and ragged valid lengths
case([9, 30, 2], [5, 3, 0], 5, 4, 2, 16, 64, None, [1, 2, 5])
# lengths spanning several chunks (chunk = 256) and multi-query heads (r = 4), D = 32
case([300, 600], [4, 2], 4, 8, 2, 32, 1024, None, [0, 1])
# a sliding window, head_dim not a power of two
case([40, 10], [3, 3], 3, 2, 1, 24, 128, 8, [2, 4])


def rope_case(bsz, seq, n_heads, n_kv, dim, dtype):
    """fused.rotary_write (eager) vs the kernel: q, k, v strided slices of one qkv output,
    the returned stacked q and both caches, padding tokens written to scratch."""
    class Cfg:
        rope_theta, rope_scaling, max_position_embeddings = 10000.0, None, 256
    qkv = torch.randn(bsz, seq, (n_heads + 2 * n_kv) * dim).to(dtype)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    q, k, v = (t.view(bsz, seq, -1, dim) for t in (q, k, v))
    batch = ExtendBatch.build(torch.arange(bsz).flip(0), torch.randint(0, 40, (bsz,)),
                              torch.tensor([seq] + [max(seq - 1, 0)] * (bsz - 1)), seq, 64, 63)
    cos, sin = RotaryEmbedding(compute_inv_freq(Cfg, dim)[0])(batch.positions, dtype)
    caches = [KVCache(bsz, 63, n_kv, dim, dtype) for _ in range(2)]
    args = (batch.write_slots, batch.write_pos)
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
    batch = ExtendBatch.build(torch.arange(bsz), torch.randint(0, 40, (bsz,)),
                              torch.tensor([seq] + [max(seq - 1, 0)] * (bsz - 1)), seq, 64, 63)
    angle = torch.rand(bsz, seq, dim) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    caches = [KVCache(bsz, 63, n_kv, dim, dtype) for _ in range(2)]
    args = (n_heads, n_kv, cos, sin)
    rows = (batch.write_slots, batch.write_pos)
    want = fused.rotary_write_fp8(raw, *scales, dtype, *args, caches[0].k_cache, caches[0].v_cache, *rows)
    assert rope.fits_fp8(raw, *scales, dim, cos, sin)
    got = rope.rotary_write_fp8(raw, *scales, dtype, *args, caches[1].k_cache, caches[1].v_cache, *rows)
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
              bias=False, window=None):
    """slot_attention of the step's NewTokens (RoPE and the KV write in its partial kernel)
    against rope.rotary_write(_fp8) then slot_attention: bit for bit, outputs and caches."""
    bsz = len(starts)
    caches = [KVCache(4, cache_len - 1, n_kv, dim, dtype) for _ in range(2)]
    caches[0].k_cache.normal_()
    caches[0].v_cache.normal_()
    caches[1].k_cache.copy_(caches[0].k_cache)
    caches[1].v_cache.copy_(caches[0].v_cache)
    slots = torch.tensor([3, 0, 2][:bsz])
    kv_len = max(s + n for s, n in zip(starts, n_valid))
    batch = ExtendBatch.build(slots, torch.tensor(starts), torch.tensor(n_valid), seq, kv_len,
                              cache_len - 1)
    angle = torch.rand(bsz, seq, dim) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    n = (n_heads + 2 * n_kv) * dim
    writes = (batch.write_slots, batch.write_pos)
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
    cells = cache_len - 1                          # the scratch position is not written
    for a, b in ((caches[1].k_cache, caches[0].k_cache), (caches[1].v_cache, caches[0].v_cache)):
        assert torch.equal(a[:, :, :cells], b[:, :, :cells]), (starts, dtype, raw)


fold_case([5, 0, 17], [1, 1, 1], 1, 4, 2, 16, 64, torch.float32, False)        # decode
fold_case([9, 30, 2], [5, 3, 0], 5, 4, 2, 16, 64, torch.float32, False)        # a padding row
fold_case([60, 1], [5, 3], 5, 8, 2, 32, 256, torch.float16, False)   # new tokens over 2 chunks
fold_case([60, 1, 7], [5, 3, 0], 5, 8, 2, 32, 256, torch.float32, True, bias=True)   # raw FP8
fold_case([60, 1], [5, 3], 5, 8, 2, 32, 256, torch.bfloat16, True, quantize=True)
fold_case([40, 10], [3, 3], 3, 4, 2, 16, 128, torch.float32, False, window=8)   # sliding window
fold_case([124, 3], [9, 6], 9, 4, 1, 16, 256, torch.float32, True)   # 9 tokens over chunk 1 | 2
print("ok")
'''


def test_slot_attention_equals_grouped_attention(scripts):
    scripts["cases"].check()


QUANTIZATIONS = [None, "fp8"]

MODEL_CASE = r'''
import sys
import torch
from runtime.models import load_model
from runtime.models.arch import kernels, quant
from runtime.models.arch.kernels import attention as attention_kernel, rope

path, quantization = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
# fixed prompts: with FP8 weights an activation that the two paths' float32 roundings put on
# either side of an e4m3 rounding boundary moves the logits by an e4m3 step or more, so
# unseeded prompts failed now and then (once in CI; 5 of 200 seeds, the fold on or off alike)
torch.manual_seed(0)
quant.EMULATE_FP8_GEMM = quantization == "fp8"   # the fused FP8 GEMM path, emulated on CPU
eager, fast = (load_model(path, torch.float32, "cpu", quantization=quantization)
               for _ in range(2))
if quantization:
    x = torch.zeros(1, 1, fast.args.hidden_size)
    assert all(layer.self_attn.fp8_fused(x) for layer in fast.model.layers)
for model in (eager, fast):
    model.allocate_cache(4, 64)
prompts = torch.randint(0, 96, (3, 12))
slots, zeros = torch.tensor([2, 0, 3]), torch.zeros(3, dtype=torch.long)
steps = [(prompts, zeros, torch.tensor([12, 7, 10])),          # prefill, ragged
         (torch.randint(0, 96, (3, 5)), torch.tensor([12, 7, 10]), torch.tensor([5, 3, 1])),
         (torch.randint(0, 96, (3, 1)), torch.tensor([17, 10, 11]), torch.tensor([1, 1, 1]))]
calls = []                              # the separate RoPE kernel's launches
for name in ("rotary_write", "rotary_write_fp8"):
    def counted(*args, _fn=getattr(rope, name)):
        calls.append(1)
        return _fn(*args)
    setattr(rope, name, counted)
for ids, start, n in steps:
    kernels.disable()
    want = eager.forward_static(ids, slots, start, n, kv_len=64)
    assert kernels.enable(torch.device("cpu"))
    ok = torch.arange(ids.shape[1])[None, :] < n[:, None]
    for fold in (True, False):          # RoPE in the attention kernel, then separate
        attention_kernel.FOLD_ROPE_MIN_SEQ = 2 if fold else 1 << 30
        del calls[:]
        got = fast.forward_static(ids, slots, start, n, kv_len=64)
        folds = fold and ids.shape[1] >= 2                 # not decode
        assert len(calls) == (0 if folds else fast.args.n_layers), (fold, len(calls))
        err = (got[ok] - want[ok]).abs().max().item()
        assert err < 1e-4, err
print("ok")
'''


@pytest.fixture(scope="module")
def scripts(llama_path):
    """This file's interpreted scripts, started at once (each is one busy core's work) and
    checked by their tests."""
    started = {"cases": start_interpreted(CASES)}
    for quantization in QUANTIZATIONS:
        started[quantization] = start_interpreted(
            MODEL_CASE, llama_path, *([quantization] if quantization else []))
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
