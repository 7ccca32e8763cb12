"""The slot-attention kernel (runtime/models/kernels/attention.py) over a long cache with short
rows, where most chunks are dead, and its FP8 variant (quantize=True), under the Triton
interpreter on the CPU. Every buffer the kernel allocates starts NaN-filled here, so a read
of a partial that no program wrote poisons the output."""

from __future__ import annotations

import pytest

from tests.interpreted import start_interpreted

pytestmark = pytest.mark.timeout(300)

SETUP = r'''
import torch
from runtime.models.arch.attention import grouped_attention
from tests import paged
from runtime.models.arch import fused
from runtime.models.arch.elementwise import stack_heads
from runtime.models.kernels import attention as kernel, available

assert available(torch.device("cpu"))
torch.manual_seed(0)
kernel.CHUNK = 32                      # 32-position chunks: many of them, rows live in a few


def poisoned(alloc):
    def nan_filled(*args, **kwargs):
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return nan_filled


def with_nan_buffers(fn, *args, **kwargs):
    """fn(*args, **kwargs) while torch.empty / empty_like return NaN-filled tensors."""
    saved = torch.empty, torch.empty_like
    torch.empty, torch.empty_like = (poisoned(f) for f in saved)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.empty, torch.empty_like = saved


def setup(starts, n_valid, seq, slots, n_heads, n_kv, dim, cache_len, dtype):
    """A random pool of 8 rows' blocks (stored shuffled), the batch over rows `slots` and its
    stacked queries."""
    cache, tables = paged.shuffled(*paged.pool(8, cache_len, n_kv, dim, dtype))
    batch = paged.batch(cache, tables[torch.tensor(slots)], starts, n_valid, seq)
    q = stack_heads(torch.randn(len(starts), seq, n_heads, dim).to(dtype), n_kv)
    return cache, batch, q
'''

LONG_CACHE = (
    SETUP
    + r'''
def case(starts, n_valid, seq, slots, window=None, n_heads=8, n_kv=2, dim=16, cache_len=1024):
    """Eager grouped_attention over the cache views vs the kernel: every valid query within
    1e-4, padding queries exactly 0, and no partial stored for a dead chunk."""
    cache, batch, q = setup(starts, n_valid, seq, slots, n_heads, n_kv, dim, cache_len,
                            torch.float32)
    k_all, v_all = cache.read(batch)
    want = grouped_attention(q, k_all, v_all, batch.mask(window), seq)     # [B, T, H, D]
    rows = batch.int32_rows()
    args = (q, cache.k_cache, cache.v_cache, batch.block_table, *rows, seq, window)
    got = with_nan_buffers(kernel.slot_attention, *args)
    ok = batch.valid
    err = (got[ok] - want[ok]).abs().max().item()
    assert err < 1e-4, (starts, n_valid, seq, err)
    assert torch.all(got[~ok] == 0)
    chunk, n_chunks = kernel.chunks(cache_len, len(starts) * n_kv)
    o, m, l = with_nan_buffers(kernel._partials, q, cache.k_cache, cache.v_cache,
                               batch.block_table, *rows, seq, window, chunk, n_chunks)
    assert o.shape[2] == cache_len // chunk
    for b, length in enumerate(torch.where(ok, batch.positions + 1, 0).amax(1).tolist()):
        live = -(-length // chunk)
        for part in (o[b], m[b], l[b]):
            assert not part[:, :live, : q.shape[2]].isnan().any()          # written
            assert part[:, live:].isnan().all()                             # dead: untouched
    return got


# decode (T=1), rows of length 5..40 in a 1024-position cache (32 chunks, 1 or 2 live), a
# padding row, slots out of order
case([4, 30, 39, 16], [1, 1, 1, 0], 1, [5, 0, 7, 2])
# verify (T=5), ragged valid lengths (padding queries inside rows), a padding row, r = 4
case([0, 30, 12, 35], [5, 3, 0, 5], 5, [3, 6, 1, 4])
# a sliding window: the first live chunk of the long rows attends nothing
case([33, 2], [3, 3], 3, [2, 0], window=8, n_heads=4, n_kv=1, dim=24)
print("ok")
'''
)

FP8 = (
    SETUP
    + r'''
def case(starts, n_valid, seq, slots, n_heads, n_kv, dim, dtype, cache_len=512):
    """slot_attention(..., quantize=True) vs fused.fp8_quantize_heads of the plain output
    (fp8_quantize_rows of it [B*T, H*D]): equal bit for bit, padding tokens zero with the
    scale of an all-zero row."""
    cache, batch, q = setup(starts, n_valid, seq, slots, n_heads, n_kv, dim, cache_len, dtype)
    args = (q, cache.k_cache, cache.v_cache, batch.block_table, *batch.int32_rows(), seq)
    out = kernel.slot_attention(*args)                                     # [B, T, H, D]
    want_data, want_scale = fused.fp8_quantize_heads(out)
    data, scale = with_nan_buffers(kernel.slot_attention, *args, quantize=True)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert data.shape == (len(starts) * seq, n_heads * dim) and scale.shape == (data.shape[0], 1)
    assert torch.equal(scale, want_scale), (scale - want_scale).abs().max()
    diff = (data.float() != want_data.float()).sum().item()
    assert diff == 0, (starts, n_valid, dtype, diff)
    pad = ~batch.valid.flatten()
    assert torch.all(data[pad].float() == 0)
    assert torch.all(scale[pad] == torch.tensor(1e-12) / 448.0)


# verify (T=5), padding tokens and a padding row, r = 4 (H 8, Hkv 2); rows over up to 10
# of the 16 chunks
case([9, 300, 40, 0], [5, 3, 2, 0], 5, [1, 2, 5, 0], 8, 2, 16, torch.bfloat16)
case([9, 300, 40, 0], [5, 3, 2, 0], 5, [1, 2, 5, 0], 8, 2, 16, torch.float32)
# decode (T=1), H 6 over Hkv 2 (heads not a power of two), head_dim 24, float16
case([100, 7, 250], [1, 1, 1], 1, [4, 3, 6], 6, 2, 24, torch.float16)
print("ok")
'''
)


@pytest.fixture(scope="module")
def scripts():
    """This file's interpreted scripts, started at once (each is one busy core's work) and
    checked by their tests."""
    started = {"long": start_interpreted(LONG_CACHE), "fp8": start_interpreted(FP8)}
    yield started
    for script in started.values():
        script.kill()


def test_long_cache_short_rows_reads_no_dead_chunk(scripts):
    """Rows of 5..40 positions in a 1024-position cache equal eager attention; dead chunks
    store no partial and the combine reads none (NaN-filled buffers stay out of the result)."""
    scripts["long"].check()


def test_quantize_equals_fp8_quantize_rows_of_the_output(scripts):
    """quantize=True (combine and per-token FP8 quantization in one launch) equals
    fused.fp8_quantize_rows of the plain output, bf16 / float16 / float32."""
    scripts["fp8"].check()
