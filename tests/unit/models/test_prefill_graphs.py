"""runtime.models.runners.prefill_runner (prompts in bucketed static chunks, CUDA graphs on CUDA) on
CPU, where the same chunks run eagerly: the chunked prefill must write the KV cache and give
the logits of the eager forward_extend at the prompt's own shape, for single rows, ragged
batches and chunks continuing a cache; the shapes captured at startup, the switch back to
the eager prefill, and (interpreted) the Triton attention kernel serving a chunk."""

from __future__ import annotations

import pytest
import torch

from runtime.models import kernels, load_model
from runtime.models.runners.graphs import batch_buckets, kv_bucket
from runtime.models.runners.prefill_runner import MAX_TOKENS, PrefillRunner
from runtime.models.runners.step_runner import StepRunner
from runtime.worker.draft_shard import DraftShard
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")
CACHE_LEN = 400


def fresh(path: str, slots: int = 8, cache_len: int = CACHE_LEN):
    model = load_model(path, torch.float32, CPU)
    model.allocate_cache(slots, cache_len)
    return model


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def assert_same_kv(a, b, slots: list[int], lengths: list[int]) -> None:
    """Every layer's keys and values of each slot's first `length` positions."""
    for la, lb in zip(a.model.layers, b.model.layers):
        ca, cb = la.self_attn.kv_cache, lb.self_attn.kv_cache
        for slot, n in zip(slots, lengths):
            for x, y in ((ca.k_cache, cb.k_cache), (ca.v_cache, cb.v_cache)):
                torch.testing.assert_close(x[slot, :, :n], y[slot, :, :n], rtol=1e-5, atol=1e-5)


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, lengths: list[int]) -> None:
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, 32], ids=["chunk256", "chunk32"])
def test_chunked_prefill_equals_eager(llama_path, max_tokens):
    """Prompts of 1..300 tokens at batch 1: one chunk or several (of 256 or 32 tokens)."""
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = PrefillRunner(static, CPU, batch_buckets(4), capture=False, max_tokens=max_tokens)
    lengths = [1, 7, 16, 17, 100, 300]
    for slot, prompt in enumerate(prompts_of(lengths)):
        ids, meta = torch.tensor([prompt]), ([slot], [0], [len(prompt)])
        want = eager.forward_extend(ids, *(torch.tensor(m) for m in meta))
        got = runner.run(ids, *meta)
        assert got.shape == want.shape
        assert_same_logits(got, want, [len(prompt)])
    assert_same_kv(eager, static, list(range(len(lengths))), lengths)
    assert runner.graphs == {}  # no capture on CPU


@pytest.mark.parametrize("slots", [[5, 0, 2], [0, 1, 2]], ids=["gather", "contiguous"])
def test_ragged_batch_then_continued_chunks(llama_path, slots):
    """A ragged batch of three prompts (batch bucket 4: chunks of 128), then a second call
    appending ragged rows after them: each chunk attends the KV written before it."""
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = StepRunner(static, CPU, max_batch=8, max_step_len=4)
    assert runner.chunked is not None and runner.chunked.chunk_for(4) == 128
    first, second = [300, 17, 100], [40, 3, 90]
    for lengths, starts, seed in ((first, [0, 0, 0], 1), (second, first, 2)):
        rows = prompts_of(lengths, seed)
        meta = (slots, starts, lengths)
        want = eager.forward_extend(padded(rows), *(torch.tensor(m) for m in meta))
        got = runner.run(padded(rows), *meta)
        assert_same_logits(got, want, lengths)
    assert_same_kv(eager, static, slots, [a + b for a, b in zip(first, second)])


def test_ids_wider_than_every_row(llama_path):
    """Columns past every row's valid length (ids [1, 300], 17 valid) run in no chunk; the
    logits still come back [B, T, V], right where valid."""
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = PrefillRunner(static, CPU, [1], capture=False)
    ids = padded(prompts_of([17], 4) + [[1] * 300])[:1]  # [1, 300]
    want = eager.forward_extend(ids, torch.tensor([2]), torch.tensor([5]), torch.tensor([17]))
    got = runner.run(ids, [2], [5], [17])
    assert got.shape == want.shape
    assert_same_logits(got, want, [17])


def test_prefill_without_logits_writes_the_same_cache(llama_path):
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = StepRunner(static, CPU, max_batch=4, max_step_len=2)
    lengths = [260, 33]
    rows = prompts_of(lengths, 3)
    assert runner.prefill(padded(rows), [3, 1], [0, 0], lengths) is None
    eager.forward_extend(
        padded(rows), torch.tensor([3, 1]), torch.tensor([0, 0]), torch.tensor(lengths)
    )
    assert_same_kv(eager, static, [3, 1], lengths)


def test_startup_keys_bounded_and_shortest_first(llama_path, monkeypatch):
    model = fresh(llama_path, cache_len=CACHE_LEN)
    runner = PrefillRunner(model, CPU, batch_buckets(8), capture=False)
    keys = runner.startup_keys(limit=1000)
    assert len(keys) == len(set(keys))
    assert all(b * c <= MAX_TOKENS for b, c, _ in keys)
    assert {c for b, c, _ in keys if b == 1} == {16, 32, 64, 128, 256}
    assert max(c for b, c, _ in keys if b == 8) == 64
    assert [k[2] for k in keys] == sorted(k[2] for k in keys)  # no kernel: KV buckets
    assert {kv for _, _, kv in keys} == {256, CACHE_LEN}
    assert runner.startup_keys(limit=5) == keys[:5]
    # with the kernels (slot kernel up to 128 stacked rows, prefill kernel beyond), every
    # chunk needs one graph for every KV length
    monkeypatch.setattr(kernels, "enabled", lambda: True)
    assert runner.rows_per_token == 2  # the tiny model: 4 heads over 2 KV heads
    keys = runner.startup_keys(limit=1000)
    assert all(kv == CACHE_LEN for _, _, kv in keys)
    assert sorted(keys) == sorted({(b, c, CACHE_LEN) for b, c, _ in keys})
    assert runner.attended(64, 10) == CACHE_LEN and runner.attended(128, 10) == CACHE_LEN
    # a head_dim the prefill kernel does not take: longer chunks go back to KV buckets
    runner.head_dim = 512
    assert runner.attended(64, 10) == CACHE_LEN and runner.attended(128, 10) == kv_bucket(
        10, CACHE_LEN
    )


def test_capture_all_counts_prefill_graphs(llama_path, monkeypatch):
    """capture_all captures the prompt chunks' graphs after the decode graphs, all of them
    reported to `progress`; shapes captured before are not captured again."""
    runner = StepRunner(fresh(llama_path), CPU, max_batch=2, max_step_len=2)
    runner.capture = runner.chunked.capture = True
    captured = []
    monkeypatch.setattr(runner, "_capture", lambda key: runner.graphs.setdefault(key, key))
    monkeypatch.setattr(
        runner.chunked,
        "capture_key",
        lambda key: captured.append(key) or runner.chunked.graphs.setdefault(key),
    )
    calls = []
    total = runner.capture_all([1, 2], progress=lambda done, n: calls.append((done, n)))
    n_prefill = len(runner.chunked.startup_keys())
    assert captured == runner.chunked.startup_keys() and n_prefill > 0
    assert total == len(runner.graphs) + n_prefill
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    captured.clear()
    assert runner.capture_all([1, 2]) == total and captured == []


def test_switch_back_to_eager_prefill(llama_path):
    assert StepRunner(fresh(llama_path), CPU, 4, 2, prefill_graphs=False).chunked is None
    assert StepRunner(fresh(llama_path), CPU, 4, 2).chunked is not None


def test_draft_shard_prefill_chunked_or_eager(llama_path):
    """A shard's prefill (a batch of new rows) writes the same cache either way, and the
    proposals decoded after it are the same tokens."""
    models, proposals = [], []
    prompts = prompts_of([120, 2, 45], 5)
    for chunked in (True, False):
        shard = DraftShard(
            fresh(llama_path), CPU, 8, CACHE_LEN, max_step_len=2, prefill_graphs=chunked
        )
        assert (shard.runner.chunked is not None) == chunked
        shard.prefill([1, 4, 6], prompts)
        proposals.append(shard.propose([1, 4, 6], 4)[0].tolist())
        models.append(shard.model)
    assert proposals[0] == proposals[1]
    assert_same_kv(models[0], models[1], [1, 4, 6], [len(p) - 1 + 4 for p in prompts])


KERNEL_CASE = r"""
import sys
import torch
from runtime.models import load_model
from runtime.models import kernels
from runtime.models.runners.prefill_runner import PrefillRunner

path = sys.argv[1]
eager, fast = (load_model(path, torch.float32, "cpu") for _ in range(2))
for model in (eager, fast):
    model.allocate_cache(4, 80)
assert kernels.enable(torch.device("cpu"))
runner = PrefillRunner(fast, torch.device("cpu"), [1, 2], capture=False, max_tokens=32)
assert runner.kernel_serves(32) and runner.chunk_for(1) == 32 and runner.chunk_for(2) == 16
g = torch.Generator().manual_seed(0)
calls = [([3], [0], [40], 40),            # batch 1: chunks of 32 and 8 (bucket 16)
         ([0, 2], [0, 0], [21, 9], 21),   # ragged batch of 2: chunks of 16
         ([3, 0], [40, 21], [5, 12], 12)] # continuing both caches
for slots, starts, n, width in calls:
    ids = torch.randint(3, 96, (len(slots), width), generator=g)
    got = runner.run(ids, slots, starts, n)
    kernels.disable()
    want = eager.forward_extend(ids, torch.tensor(slots), torch.tensor(starts), torch.tensor(n))
    assert kernels.enable(torch.device("cpu"))
    for b, k in enumerate(n):
        err = (got[b, :k] - want[b, :k]).abs().max().item()
        assert err < 1e-4, (slots, b, err)
print("ok")
"""


def test_chunks_through_the_triton_kernel_equal_eager(llama_path):
    """Under TRITON_INTERPRET=1 the chunks attend through the Triton kernel (causal within
    the chunk, over the KV earlier chunks wrote, ragged rows): the eager logits."""
    run_interpreted(KERNEL_CASE, llama_path)


@pytest.mark.parametrize("lengths", [[260, 33, 1], [5], [300, 299]])
def test_prefill_last_gives_each_rows_last_logits(llama_path, lengths):
    """StepRunner.prefill_last: each row's logits at its last valid token, whichever chunk
    holds it (rows ending in different chunks, a 1-token row), equal to the eager forward's;
    the cache as prefill writes it."""
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = StepRunner(static, CPU, max_batch=4, max_step_len=2)
    rows = prompts_of(lengths, 8)
    slots = [3, 1, 0][: len(rows)]
    got = runner.prefill_last(padded(rows), slots, [0] * len(rows), lengths)  # [B, V]
    want = eager.forward_extend(
        padded(rows), torch.tensor(slots), torch.tensor([0] * len(rows)), torch.tensor(lengths)
    )
    assert got.shape == (len(rows), want.shape[-1])
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b], want[b, n - 1], rtol=1e-4, atol=1e-4)
    assert_same_kv(eager, static, slots, lengths)


@pytest.mark.parametrize("long_tokens", [64, 2048], ids=["chunks-of-32", "one-chunk"])
def test_long_prompts_in_eager_chunks_equal_eager(llama_path, long_tokens):
    """Rows longer than a graph chunk go in long eager chunks (PrefillRunner._run_long, the
    hidden states only): each row's last logits and the cache equal the eager forward's,
    over a cached prefix too (rows starting past 0), rows ending in different chunks."""
    eager, static = fresh(llama_path), fresh(llama_path)
    runner = PrefillRunner(
        static,
        CPU,
        batch_buckets(2),
        capture=False,
        max_tokens=32,
        long_tokens=long_tokens,
        long_min=64,
    )
    lengths, slots = [150, 70], [1, 0]
    head = prompts_of([30, 30], 11)
    rows = prompts_of(lengths, 12)
    for model in (eager, static):  # a cached prefix of 30 tokens per row
        model.forward_extend(
            padded(head), torch.tensor(slots), torch.tensor([0, 0]), torch.tensor([30, 30])
        )
    assert runner.goes_long(2, lengths) and not runner.goes_long(2, [16, 3])
    assert not runner.goes_long(2, [63, 3])  # over a graph chunk, under long_min
    got = runner.run(padded(rows), slots, [30, 30], lengths, logits="last")  # [B, V]
    want = eager.forward_extend(
        padded(rows), torch.tensor(slots), torch.tensor([30, 30]), torch.tensor(lengths)
    )
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b], want[b, n - 1], rtol=1e-4, atol=1e-4)
    assert runner.run(padded(rows), slots, [30, 30], lengths, logits=False) is None
    assert_same_kv(eager, static, slots, [30 + n for n in lengths])
