"""The prefill flash-attention kernel (runtime/models/kernels/prefill_attention.py) against
its eager reference, grouped_attention over KVCache.read and ExtendBatch.mask, under the
Triton interpreter on the CPU (TRITON_INTERPRET=1 set before triton loads): chunks with and
without a cached prefix, shuffled block tables, ragged rows with padding queries, GQA and
r = 1, sliding windows, float32 (exact to 1e-5), bf16 and an FP8 cache. Two scripts, started
together (one core each)."""

from __future__ import annotations

import pytest

from tests.interpreted import start_interpreted

pytestmark = pytest.mark.timeout(300)

SETUP = r'''
import sys
import torch
from runtime.models.arch import fp8_elementwise
from runtime.models.arch.attention import grouped_attention
from runtime.models.arch.cache import KVCache, blocks_for
from runtime.models.arch.elementwise import stack_heads
from runtime.models.kernels import available
from runtime.models.kernels import prefill_attention as kernel
from tests import paged

assert available(torch.device("cpu"))
torch.manual_seed(0)


def reference(q, cache, batch, window, seq):
    """grouped_attention in float32 over the gathered rows (an FP8 cache's dequantized in
    float32: e4m3 * scale, not rounded to the activation dtype as KVCache.read returns them)."""
    dtype, cache.dtype = cache.dtype, torch.float32
    try:
        k_all, v_all = cache.read(batch)
    finally:
        cache.dtype = dtype
    return grouped_attention(q.float(), k_all.float(), v_all.float(), batch.mask(window), seq)


def check(got, want, batch, tol):
    """Valid queries within tol of the reference (relative to its largest value where that
    is over 1); padding queries exactly zero (the
    reference's see position 0 instead); nothing NaN. -> the max error."""
    ok = batch.valid
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = (got[ok].float() - want[ok]).abs().max().item() / max(1.0, want[ok].abs().max())
    assert err < tol, err
    print(f"{got.dtype} max err {err:.2e}", file=sys.stderr)
    assert torch.all(got[~ok] == 0)
    return err


def run(q, cache, table, batch, window):
    return kernel.prefill_attention(q, cache.k_cache, cache.v_cache, table,
                                    *batch.int32_rows(), window, cache.scales)
'''

FLOAT32 = (
    SETUP
    + r'''
def case(starts, n_valid, seq, n_heads, n_kv, dim, window=None, block_size=16, rows=4,
         cache_len=128):
    """float32: the kernel against the reference, through fixed then shuffled tables (the
    same K/V in other blocks: the same bits); a wrong table gives another result."""
    bsz = len(starts)
    cache, tables = paged.pool(rows, cache_len, n_kv, dim, torch.float32, block_size)
    slots = torch.tensor([(3 * i + 1) % rows for i in range(bsz)])
    table = tables[slots]
    batch = paged.batch(cache, table, starts, n_valid, seq)
    q = stack_heads(torch.randn(bsz, seq, n_heads, dim), n_kv)            # [B, Hkv, r*T, D]
    assert kernel.fits(q, cache.k_cache)
    want = reference(q, cache, batch, window, seq)
    got = run(q, cache, table, batch, window)
    check(got, want, batch, 1e-5)
    mixed, mixed_tables = paged.shuffled(cache, tables)
    mixed_table = mixed_tables[slots]
    assert not torch.equal(mixed_table, table)
    assert torch.equal(run(q, mixed, mixed_table, batch, window), got)
    # the fixed table over the shuffled pool reads other positions' K/V: another result
    wrong = run(q, mixed, table, batch, window)
    assert (wrong[batch.valid] - got[batch.valid]).abs().max() > 1e-2
    return q, cache, table, batch, got


# a chunk with no prefix (40 tokens: 3 query blocks of 16, the last part-filled), r = 4
case([0], [40], 40, 8, 2, 16)
# a chunk of 20 over a prefix of 37 (blocks of 8: several; the unmasked part), r = 1, D = 32
case([37], [20], 20, 2, 2, 32, block_size=8)
# a ragged batch: different starts and valid counts, padding queries, an all-padding row;
# r = 2, blocks of 5 positions (not dividing a row's), head_dim 24 (a padded tile)
case([0, 50, 13, 70], [24, 9, 17, 0], 24, 4, 2, 24, block_size=5)
# sliding windows: narrower than a step (masked edge only), wider than the chunk
q, cache, table, batch, narrow = case([30, 5], [20, 12], 20, 4, 1, 16, window=7)
full = run(q, cache, table, batch, None)
assert (full[batch.valid] - narrow[batch.valid]).abs().max() > 1e-2   # the window matters
case([45, 3], [30, 26], 30, 4, 1, 16, window=40)
case([60], [33], 33, 2, 1, 16, window=1)                              # each query: itself
# other block shapes: query blocks wider / narrower than the KV steps, r = 4 over a prefix
for blocks in ((32, 16, 4, 1), (16, 32, 4, 1)):
    kernel.INTERPRET_CONFIG = blocks
    case([21, 0], [40, 33], 40, 4, 1, 16)
    case([50, 17], [30, 30], 30, 4, 1, 16, window=19)
kernel.INTERPRET_CONFIG = (16, 16, 4, 1)

# fits: any head_dim up to 256, the pool's dtype or e4m3 with scales
pool = torch.zeros(3, 2, 16, 24)
assert kernel.fits(torch.zeros(1, 2, 8, 24), pool)
assert not kernel.fits(torch.zeros(1, 2, 8, 512), torch.zeros(3, 2, 16, 512))   # > 256
assert not kernel.fits(torch.zeros(1, 4, 8, 24), pool)                          # Hkv differs
assert not kernel.fits(torch.zeros(1, 2, 8, 24, dtype=torch.float16), pool)     # dtype differs
fp8_pool = pool.to(torch.float8_e4m3fn)
assert not kernel.fits(torch.zeros(1, 2, 8, 24), fp8_pool)                      # no scales
assert kernel.fits(torch.zeros(1, 2, 8, 24), fp8_pool, (torch.zeros(3, 2, 16),) * 2)
print("ok")
'''
)

LOW_PRECISION = (
    SETUP
    + r'''
def fp8_pool(rows, cache_len, n_kv, dim, dtype, block_size=16):
    """An FP8 pool of random K/V (fp8_elementwise.fp8_quantize_kv, scales varying by position)
    and the rows' fixed tables."""
    m = blocks_for(cache_len, block_size)
    cache = KVCache(rows * m, block_size, n_kv, dim, dtype, kv_dtype="fp8")
    for data, scale in ((cache.k_cache, cache.k_scale), (cache.v_cache, cache.v_scale)):
        x = torch.randn(rows * m + 1, n_kv, block_size, dim)
        x = x * torch.rand(rows * m + 1, n_kv, block_size, 1) * 4
        d, s = fp8_elementwise.fp8_quantize_kv(x)
        data.copy_(d)
        scale.copy_(s)
    return cache, paged.pool(rows, cache_len, n_kv, dim, dtype, block_size, False)[1]


def case(dtype, starts, n_valid, seq, n_heads, n_kv, dim, window=None, fp8=False, tol=1e-5):
    bsz = len(starts)
    make = fp8_pool if fp8 else paged.pool
    cache, tables = make(3, 112, n_kv, dim, dtype)
    if not fp8:
        cache, tables = paged.shuffled(cache, tables)
    table = tables[torch.tensor([2, 0, 1][:bsz])]
    batch = paged.batch(cache, table, starts, n_valid, seq)
    q = stack_heads(torch.randn(bsz, seq, n_heads, dim), n_kv).to(dtype)
    assert kernel.fits(q, cache.k_cache, cache.scales)
    got = run(q, cache, table, batch, window)
    assert got.dtype == dtype
    check(got, reference(q, cache, batch, window, seq), batch, tol)
    return q, cache, table, batch, got


# bf16 (bf16 dots, P rounded to bf16 for P @ V): a ragged batch over shuffled prefixes, r = 4
case(torch.bfloat16, [40, 0], [35, 21], 35, 8, 2, 32, tol=2e-2)
case(torch.bfloat16, [70, 9], [25, 25], 25, 2, 2, 16, window=12, tol=2e-2)       # r = 1
case(torch.float16, [20], [30], 30, 4, 1, 16, tol=2e-3)
# an FP8 cache (e4m3 + per-position scales) against its dequantized read: float32 queries
# (exact but for where the scales multiply), then bf16
q, cache, table, batch, got = case(torch.float32, [50, 0, 7], [30, 22, 0], 30, 4, 2, 16,
                                   fp8=True, tol=1e-5)
cache.k_scale.mul_(2.0)                  # the kernel reads K's scales ...
k_bad = run(q, cache, table, batch, None)
cache.k_scale.div_(2.0)
cache.v_scale.mul_(2.0)                  # ... and V's
v_bad = run(q, cache, table, batch, None)
ok = batch.valid
assert (k_bad[ok] - got[ok]).abs().max() > 1e-2
torch.testing.assert_close(v_bad[ok], 2 * got[ok], rtol=1e-5, atol=1e-5)
case(torch.bfloat16, [45, 12], [30, 30], 30, 8, 2, 32, window=20, fp8=True, tol=2e-2)
print("ok")
'''
)


@pytest.fixture(scope="module")
def scripts():
    started = {"float32": start_interpreted(FLOAT32), "low": start_interpreted(LOW_PRECISION)}
    yield started
    for script in started.values():
        script.kill()


def test_float32_equals_grouped_attention(scripts):
    """float32, every valid query within 1e-5 of grouped_attention, padding queries zero:
    no prefix, a prefix over several blocks, a ragged batch (an all-padding row, blocks of
    5, head_dim 24), r = 1 / 2 / 4, windows of 1, 7 (< a KV step), 19 and 40, other block
    shapes; shuffled tables give the same bits and a wrong table another result."""
    scripts["float32"].check()


def test_bf16_and_fp8_cache_close_to_grouped_attention(scripts):
    """bf16 / fp16 queries and caches within 2e-2 / 2e-3 (relative to the output's largest
    value) of the float32 reference; an FP8 cache (kv_scales) against its float32
    dequantized read, float32 queries within 1e-5 and bf16 within 2e-2, its K and V scales
    both read."""
    scripts["low"].check()
