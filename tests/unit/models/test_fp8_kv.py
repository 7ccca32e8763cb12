"""The FP8 KV cache (runtime.kv_cache_dtype "fp8": KVCache(kv_dtype="fp8"), e4m3 K/V with a
float32 scale per position and KV head): the quantization's error bound, a tiny Llama's
logits against the activation-dtype cache (eager, and through the Triton RoPE and attention
kernels under the interpreter, RoPE folded into attention or not, float and FP8 weights),
that the scales are read (a corrupted scale moves the logits), that padding tokens write only
the scratch block, and the byte counts the budget and the pool sizing use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.models import load_model
from runtime.models.arch import fp8_elementwise
from runtime.models.arch.cache import KVCache
from runtime.models.runners.kv_budget import block_bytes, cache_bytes
from tests.checkpoints import build_checkpoint
from tests.interpreted import start_interpreted

pytestmark = pytest.mark.timeout(120)

ROWS, CACHE_LEN = 3, 64
TABLES = torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
STEPS = [  # (tokens a row, starts, valid lengths): a ragged prefill, a verify, decode steps
    (12, [0, 0, 0], [12, 7, 10]),
    (5, [12, 7, 10], [5, 3, 1]),
    (1, [17, 10, 11], [1, 1, 1]),
    (1, [18, 11, 12], [1, 1, 1]),
    (1, [19, 12, 13], [1, 1, 0]),
]
# the interpreted kernels' steps (the interpreter runs a program at a time: fewer tokens)
KERNEL_STEPS = [(6, [0, 0, 0], [6, 3, 5]), (5, [6, 3, 5], [5, 3, 1]), (1, [11, 6, 6], [1, 1, 0])]
MIN_COSINE = 0.999  # fp8 KV against the activation-dtype KV, each valid token's logits


# ---- helpers, shared with the interpreted script ------------------------------------------


def build(
    path: str,
    kv_dtype: str,
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    block_size: int = 16,
):
    model = load_model(path, dtype, "cpu", quantization=quantization)
    model.allocate_cache(ROWS, CACHE_LEN, block_size, kv_dtype=kv_dtype)
    return model


def run_steps(model, steps=STEPS) -> list[torch.Tensor]:
    """steps through forward_static with TABLES (fixed ids) -> each step's valid logits
    [valid tokens, V] in float32."""
    g = torch.Generator().manual_seed(11)
    out = []
    for seq, starts, n_valid in steps:
        ids = torch.randint(3, 96, (ROWS, seq), generator=g)
        n = torch.tensor(n_valid)
        logits = model.forward_static(ids, TABLES, torch.tensor(starts), n, CACHE_LEN)
        out.append(logits[torch.arange(seq)[None, :] < n[:, None]].float())
    return out


def min_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return min(
        torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item() for x, y in zip(a, b)
    )


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_fp8_close_to_auto(fp8: list[torch.Tensor], auto: list[torch.Tensor]) -> None:
    """Close (cosine) but not equal: the fp8 cache was used and costs a little."""
    cos = min_cosine(fp8, auto)
    assert cos > MIN_COSINE, cos
    assert max_err(fp8, auto) > 1e-4, "fp8 KV gave the auto cache's logits: not quantized?"


def corruption_effects(path: str, steps=STEPS[:3]) -> tuple[float, float, float]:
    """Run all but the last of steps on an fp8 model, then the last (a decode step) four
    times: plain, plain again, with layer 0's k_scale x4, with layer 0's v_scale zeroed
    (each over positions the step does not write) -> (max |logit change| of the repeat, of
    the k corruption, of the v one)."""
    model = build(path, "fp8")
    run_steps(model, steps[:-1])
    step = steps[-1:]
    base = run_steps(model, step)
    again = run_steps(model, step)
    cache = model.model.layers[0].self_attn.kv_cache
    k_scale, v_scale = cache.k_scale.clone(), cache.v_scale.clone()
    cache.k_scale.mul_(4.0)
    k_bad = run_steps(model, step)
    cache.k_scale.copy_(k_scale)
    cache.v_scale.zero_()
    v_bad = run_steps(model, step)
    cache.v_scale.copy_(v_scale)
    return max_err(again, base), max_err(k_bad, base), max_err(v_bad, base)


def check_corruption(path: str, steps=STEPS[:3]) -> None:
    repeat, k_change, v_change = corruption_effects(path, steps)
    assert repeat == 0.0, repeat
    assert k_change > 0.05 and v_change > 0.05, (k_change, v_change)


PAD_STEP = (
    6,
    [10, 0, 40],
    [6, 2, 0],
)  # row 0: 6 valid at 10..15; row 1: 2 (4 padding); row 2: none


def padding_writes(path: str, step=PAD_STEP) -> bool:
    """A ragged step on an fp8 model (blocks of 8, shuffled tables) whose pools hold
    sentinels (data 7.0, scales -1.0): asserts that in every pool and scale tensor exactly
    the valid tokens' (block, offset) changed, every head of them, outside the scratch
    block; returns whether the scratch block changed (padding tokens written there)."""
    model = load_model(path, torch.float32, "cpu")
    model.allocate_cache(4, 64, 8, kv_dtype="fp8")
    pools = [
        t
        for layer in model.model.layers
        for t in (
            layer.self_attn.kv_cache.k_cache,
            layer.self_attn.kv_cache.v_cache,
            layer.self_attn.kv_cache.k_scale,
            layer.self_attn.kv_cache.v_scale,
        )
    ]
    for t in pools:
        t.copy_(torch.full(t.shape, 7.0 if t.dtype == torch.float8_e4m3fn else -1.0))
    perm = torch.randperm(model.num_blocks, generator=torch.Generator().manual_seed(2))
    tables = perm[: 3 * model.blocks_per_seq].view(3, -1).to(torch.int32)
    seq, starts, n_valid = step
    ids = torch.randint(3, 96, (3, seq), generator=torch.Generator().manual_seed(4))
    model.forward_static(ids, tables, torch.tensor(starts), torch.tensor(n_valid), 64)
    want = {
        (int(tables[b, p // 8]), p % 8)
        for b in range(3)
        for p in range(starts[b], starts[b] + n_valid[b])
    }
    scratch, scratch_written = model.num_blocks, False
    for t in pools:
        sentinel = 7.0 if t.dtype == torch.float8_e4m3fn else -1.0
        changed = t.float() != sentinel  # [N+1, Hkv, BS(, D)]
        if changed.dim() == 4:
            changed = changed.any(-1)  # [N+1, Hkv, BS]
        got = {(b, o) for b, o in changed.any(1).nonzero().tolist() if b != scratch}
        assert got == want, (sorted(got), sorted(want))
        assert all(changed[b, :, o].all() for b, o in want)  # every KV head
        scratch_written |= bool(changed[scratch].any())
    return scratch_written


# ---- eager tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def soft_llama(tmp_path_factory) -> str:
    """The tiny Llama with a usual weight scale (initializer_range 0.05): the shared one's
    0.25 makes softmaxes so sharp that e4m3's 3 mantissa bits move its logits by ~1%."""
    return build_checkpoint(
        tmp_path_factory.mktemp("fp8kv") / "llama", seed=3, initializer_range=0.05
    )


def test_quantize_round_trip_error_bound():
    """Each element back within half an e4m3 step of its row: |x| / 16 for normal values,
    scale / 1024 for subnormal ones; a zero row stays zero with a finite scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-6, 3, 64)[:, None, None]
    x[3, 1] = 0.0
    x[5, 2, 7] = 1e4  # an outlier in one row
    data, scale = fp8_elementwise.fp8_quantize_kv(x)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (64, 4)
    back = data.float() * scale[..., None]
    bound = torch.maximum(x.abs() / 16, scale[..., None] / 1024) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (back[3, 1] == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()
    amax = x.abs().amax(-1)
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0)  # 448 exact
    rel = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-30)
    assert rel[x.norm(dim=-1) > 0].max() < 0.04  # e4m3: ~2.5% RMS a row


def test_cache_read_dequantizes_what_writes_stored():
    """write_cache_kv8 then KVCache.read: every valid position within the bound above."""
    cache = KVCache(4, 8, 2, 16, torch.float32, kv_dtype="fp8")
    assert cache.k_cache.dtype == torch.float8_e4m3fn and cache.k_scale.shape == (5, 2, 8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 20, 2, 16, generator=g) * 3
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    from tests import paged

    batch = paged.batch(cache, table, [0], [20], 20)
    fp8_elementwise.write_cache_kv8(
        cache.k_cache, cache.k_scale, batch.write_blocks, batch.write_offsets, x
    )
    k, _ = cache.read(batch)  # [1, 2, 20, 16]
    want = x.permute(0, 2, 1, 3)
    assert k.dtype == torch.float32
    assert ((k - want).abs() <= want.abs() / 16 + 1e-6).all()
    assert (cache.k_scale[1] == 0).all()  # block 1: not in the table


def test_eager_model_fp8_close_to_auto(soft_llama):
    auto, fp8 = build(soft_llama, "auto"), build(soft_llama, "fp8")
    assert fp8.model.layers[0].self_attn.kv_cache.v_cache.dtype == torch.float8_e4m3fn
    assert_fp8_close_to_auto(run_steps(fp8), run_steps(auto))


def test_eager_reads_the_scales(soft_llama):
    check_corruption(soft_llama)


def test_eager_padding_writes_only_the_scratch_block(soft_llama):
    assert padding_writes(soft_llama)  # the padding tokens went to scratch


def test_bytes_count_scales_and_one_byte_values(soft_llama):
    """cache_bytes / block_bytes equal what allocate_cache allocates, fp8 and auto; the
    transformers fallback (no layers of ours) gives None."""
    for kv_dtype in ("auto", "fp8"):
        model = build(soft_llama, kv_dtype)
        allocated = sum(
            b.numel() * b.element_size() for b in model.buffers() if b.dim() >= 3
        )  # pools and scales
        assert cache_bytes(model, ROWS, CACHE_LEN, 16, kv_dtype) == allocated
        assert block_bytes(model, 16, kv_dtype) * (model.num_blocks + 1) == allocated
    # 2 layers x K,V x 2 KV heads x 16 positions x (16 values x 4 bytes | 16 x 1 + a scale)
    assert block_bytes(model, 16) == 2 * 2 * 2 * 16 * 16 * 4
    assert block_bytes(model, 16, "fp8") == 2 * 2 * 2 * 16 * (16 + 4)
    fallback = SimpleNamespace(paged=False)  # a CausalLM that allocates its own cache
    assert block_bytes(fallback, 16, "fp8") is None and cache_bytes(fallback, 1, 16) is None
    with pytest.raises(ValueError, match="kv_dtype"):
        KVCache(1, 16, 1, 16, torch.float32, kv_dtype="int8")


# ---- the Triton kernels, interpreted ----------------------------------------------------

KERNEL_SCRIPT = r"""
import sys
import torch
from runtime.models.arch import fused, quant
from runtime.models import kernels
from runtime.models.kernels import attention as attention_kernel, rope
from tests.unit.models.test_fp8_kv import (KERNEL_STEPS, assert_fp8_close_to_auto, build,
                                           check_corruption, max_err, padding_writes, run_steps)
from tests.interpreted import count_calls

path, fold = sys.argv[1], sys.argv[2] == "fold"   # RoPE and the KV write in attention, or apart
torch.manual_seed(0)
if not fold:    # the RoPE kernel's bytes: the eager write's (float32, a padding token to scratch)
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16) * 5, torch.randn(2, 3, 2, 16)
    cos, sin = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    blocks, offsets = torch.tensor([0, 0, 4, 1, 1, 1]), torch.tensor([0, 1, 0, 5, 6, 7])
    pools = [[torch.zeros(5, 2, 8, 16, dtype=torch.float8_e4m3fn) for _ in range(2)]
             + [torch.zeros(5, 2, 8) for _ in range(2)] for _ in range(2)]
    want = fused.rotary_write_kv8(q, k, v, cos, sin, *pools[0][:2], blocks, offsets,
                                  *pools[0][2:])
    got = rope.rotary_write(q, k, v, cos, sin, *pools[1][:2], blocks, offsets, *pools[1][2:])
    assert torch.equal(got, want)
    for a, b in zip(*pools):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (pools[1][2][4, :, 0] > 0).all() and (pools[1][2][2:4] == 0).all()   # scales

kernels.disable()
quant.EMULATE_FP8_GEMM = True          # the fused FP8 GEMM path (qkv epilogue in RoPE), emulated
eager = {w: run_steps(build(path, "fp8", quantization=w), KERNEL_STEPS) for w in (None, "fp8")}
auto = run_steps(build(path, "auto"), KERNEL_STEPS)
calls = count_calls(rope, ("rotary_write", "rotary_write_fp8"))   # the RoPE kernel's launches
assert kernels.enable(torch.device("cpu"))
attention_kernel.FOLD_ROPE_MIN_SEQ = 2 if fold else 1 << 30
for weights in (None, "fp8"):
    model = build(path, "fp8", quantization=weights)
    assert model.model.layers[0].self_attn.fp8_fused(torch.zeros(1, 1, 64)) == bool(weights)
    del calls[:]
    got = run_steps(model, KERNEL_STEPS)
    assert len(calls) == 2 * (1 if fold else 3), len(calls)    # 2 layers; folded: decode only
    assert max_err(got, eager[weights]) < 2e-3, (weights, max_err(got, eager[weights]))
    if weights is None:
        assert_fp8_close_to_auto(got, auto)
if fold:
    check_corruption(path, KERNEL_STEPS)
# the RoPE kernel writes padding tokens to scratch, the folded write skips them
assert padding_writes(path) != fold
if not fold:
    assert padding_writes(path, (1, [13, 1, 40], [1, 1, 0]))   # decode: row 2 pads
print("ok")
"""


@pytest.fixture(scope="module")
def kernel_scripts(soft_llama):
    scripts = {
        mode: start_interpreted(KERNEL_SCRIPT, soft_llama, mode) for mode in ("fold", "apart")
    }
    yield scripts
    for script in scripts.values():
        script.kill()


@pytest.mark.parametrize("mode", ["fold", "apart"])
def test_kernels_fp8_kv(kernel_scripts, mode):
    """Under the interpreter, RoPE and the KV write folded into the attention kernel or in
    the RoPE kernel ("apart"): whole-model steps through the kernels (float and emulated FP8
    weights) match the eager fp8 path and stay close to the auto cache; padding tokens
    write only the scratch block. Apart: the RoPE kernel writes the eager path's bytes
    (e4m3 and scales). Fold: the attention kernel reads the scales (corruption moves the
    logits)."""
    kernel_scripts[mode].check(timeout=110)
