"""The L2 prefetch (runtime/models/arch/kernels/prefetch.py) under the Triton interpreter on the CPU:
the kernel reads every word of the range it is given and nothing past it, and a model with
the prefetches on asks for the next GEMM's weights after each GEMM and computes the same
logits bit for bit."""
from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

KERNEL_CASE = r'''
import torch
from runtime.models.arch.kernels import prefetch

torch.manual_seed(0)


def wrapped_sum(t):
    """The int32 (wrapping) sum of int32 words, as a Python int in [-2**31, 2**31)."""
    s = int(t.to(torch.int64).sum()) & 0xFFFFFFFF
    return s - 2**32 if s >= 2**31 else s


for n, programs in ((50_001, 32), (50_001, 3), (8192, 1), (7, 32), (3 * 8192 + 1, 2)):
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32)
    sink = torch.zeros(programs, dtype=torch.int32)
    prefetch.read(src, sink, programs)
    assert wrapped_sum(sink) == wrapped_sum(src), (n, programs)
weight = torch.randn(64, 40)                                  # 10240 bytes of float32
words = prefetch.words(weight, 1000)                          # the first 250 words
assert words.numel() == 250 and torch.equal(words, weight.reshape(-1)[:250].view(torch.int32))
assert prefetch.words(weight, 1 << 30).numel() == 64 * 40
assert prefetch.words(weight, 3).numel() == 0
sink = torch.zeros(prefetch.PROGRAMS, dtype=torch.int32)
prefetch.read(words, sink)
assert wrapped_sum(sink) == wrapped_sum(weight.reshape(-1)[:250].view(torch.int32))
prefetch.CAPS_MB["o"] = 0.0
assert prefetch.cap_bytes("o", torch.device("cpu")) == 0
print("ok")
'''

MODEL_CASE = r'''
import sys
import torch
from runtime.models import load_model
from runtime.models.arch import kernels
from runtime.models.arch.kernels import prefetch

torch.manual_seed(0)
model = load_model(sys.argv[1], torch.float32, "cpu")
model.allocate_cache(2, 32)
kinds, reads = [], []
original_ahead, original_read = prefetch.ahead, prefetch.read


def ahead(weight, kind):
    kinds.append((kind, weight.data_ptr()))
    original_ahead(weight, kind)


def read(src, sink, programs=None):
    reads.append(src.numel())
    original_read(src, sink, programs)


prefetch.ahead, prefetch.read = ahead, read
ids, slots = torch.randint(0, 96, (2, 6)), torch.tensor([1, 0])
start, n = torch.zeros(2, dtype=torch.long), torch.tensor([6, 4])
assert kernels.enable(torch.device("cpu"))
kernels.L2_PREFETCH = False
want = model.forward_static(ids, slots, start, n, kv_len=32)
assert kinds == []
kernels.L2_PREFETCH = True
got = model.forward_static(ids, slots, start, n, kv_len=32)
assert torch.equal(got, want)
# the default caps read o_proj's weights only (docs/benchmarks.md: the other gaps are short)
assert len(reads) == len(model.model.layers) and len(kinds) == 4 * len(model.model.layers) - 1
kinds.clear(), reads.clear()
prefetch.CAPS_MB.update(qkv=1.0, o=1.0, gate_up=1.0, down=1.0)
got = model.forward_static(ids, slots, start, n, kv_len=32)
assert torch.equal(got, want)
kinds.clear(), reads.clear()
kernels.L2_MIN_TOKENS = 2                   # TANDEM_L2_PREFETCH=verify: no decode step
model.forward_static(ids[:, :1], slots, n, torch.ones(2, dtype=torch.long), kv_len=32)
assert kinds == [] and reads == []
model.forward_static(ids[:, :2], slots, n, torch.ones(2, dtype=torch.long) * 2, kv_len=32)
assert len(kinds) == 4 * len(model.model.layers) - 1
kinds.clear(), reads.clear()
kernels.L2_MIN_TOKENS = 1
got = model.forward_static(ids, slots, start, n, kv_len=32)
assert torch.equal(got, want)
layers = model.model.layers
expected = []
for i, layer in enumerate(layers):
    attn, mlp = layer.self_attn, layer.mlp
    if i > 0:
        expected.append(("qkv", attn.qkv.weight.data_ptr()))
    expected += [("o", attn.o_proj.weight.data_ptr()), ("gate_up", mlp.gate_up.weight.data_ptr()),
                 ("down", mlp.down_proj.weight.data_ptr())]
# per layer: o after qkv, gate_up after o, down after gate_up; qkv of the next after down
assert kinds == expected, kinds
assert len(reads) == len(expected) and all(r > 0 for r in reads)   # the tiny weights fit whole
print("ok")
'''


def test_the_prefetch_kernel_reads_every_word_of_its_range():
    run_interpreted(KERNEL_CASE)


def test_a_model_prefetches_each_next_gemm_and_computes_the_same(llama_path):
    run_interpreted(MODEL_CASE, llama_path)
