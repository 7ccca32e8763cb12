"""Paged KV serving end to end (real processes, CPU, float32): prefix-cache hits, preemption
for KV blocks and abandoned/invalid requests keep greedy output equal to transformers' own
greedy output token for token, leak no KV block, and a prefix hit does not change sampled
tokens (sampling is keyed by absolute position).

Three launches: the module's engine (prefix caching on, blocks of 4 tokens, draft and target
on two devices: overlapped rounds, two worker ranks reporting `cached`), a tiny KV pool (one
worker rank), and prefix caching off (the sampled comparison)."""

from __future__ import annotations

import threading
import time

import pytest

from runtime import Engine
from runtime.config import load_config
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(400)

BLOCK = 4
COMMON = [1] + [(7 * i + 3) % 90 + 3 for i in range(33)]  # 34 tokens: 8 full blocks
TAILS = [[40, 41, 42], [50, 9, 60, 61, 70], [33, 44], [80, 81, 82, 83, 84, 85]]
NEW = 24
SAMPLED = {"temperature": 1.5, "top_p": 0.95, "seed": 1234, "max_new_tokens": 20}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_models")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return draft, target


@pytest.fixture(scope="module")
def hf_model(pair):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        pair[1], torch_dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def greedy(hf_model):
    cache: dict[tuple, list[int]] = {}

    def reference(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = checkpoints.hf_generate(hf_model, prompt, n)
        return cache[key]

    return reference


def write(tmp_path, pair, devices=(("cpu:0",), ("cpu:1",)), **runtime) -> str:
    runtime = {"kv_block_size": BLOCK, "max_seq_len": 128, **runtime}
    return launch.write_config(tmp_path / "c.yaml", *pair, *devices, draft_len=4, **runtime)


@pytest.fixture(scope="module")
def engine(pair, tmp_path_factory):
    cfg = write(tmp_path_factory.mktemp("on"), pair)
    with Engine.launch(cfg) as eng:
        yield eng


def wait_idle(eng: Engine, timeout_s: float = 60.0) -> dict:
    """The server's stats once nothing runs or waits (abandoned streams are cancelled
    between rounds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = eng.stats()
        if stats["running"] == 0 and stats["queued"] == 0:
            return stats
        assert time.monotonic() < deadline, f"never idle: {stats}"
        time.sleep(0.05)


CANCELLED = 'tandem:request_success_total{finished_reason="cancelled"}'


def metric(text: str, name: str) -> float:
    """A sample's value (`name` with its labels, if any, as exposed); 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    if "{" in name:
        return 0.0
    raise AssertionError(f"{name} not in the metrics:\n{text}")


# --- (a) greedy exactness with prefix hits ----------------------------------------------------
def test_prefix_hits_keep_greedy_exact(engine, greedy):
    before = engine.stats()
    assert before["kv_blocks_total"] > 0 and before["kv_blocks_used"] == 0
    first = engine.generate(prompt_token_ids=COMMON + TAILS[0], max_new_tokens=NEW)
    assert first.token_ids == greedy(COMMON + TAILS[0], NEW)
    assert first.stats["cached_prompt_tokens"] == 0
    # the others at once: each finds the first's blocks of the common prefix
    rest = engine.generate(prompt_token_ids=[COMMON + t for t in TAILS[1:]], max_new_tokens=NEW)
    for out, tail in zip(rest, TAILS[1:]):
        assert out.token_ids == greedy(COMMON + tail, NEW)
        assert out.stats["cached_prompt_tokens"] == len(COMMON) // BLOCK * BLOCK
        assert out.stats["preemptions"] == 0
    # the same prompt again: every full block but the one holding its last token, and the
    # first's generated tokens too for a follow-up turn
    again = engine.generate(prompt_token_ids=COMMON + TAILS[0], max_new_tokens=NEW)
    assert again.token_ids == first.token_ids
    assert again.stats["cached_prompt_tokens"] == (len(COMMON + TAILS[0]) - 1) // BLOCK * BLOCK
    follow = COMMON + TAILS[0] + first.token_ids + [17, 18, 19]
    turn = engine.generate(prompt_token_ids=follow, max_new_tokens=NEW)
    assert turn.token_ids == greedy(follow, NEW)
    assert turn.stats["cached_prompt_tokens"] > len(COMMON + TAILS[0])
    stats = wait_idle(engine)
    assert stats["kv_blocks_used"] == 0
    assert stats["prefix_cache_hit_rate"] > 0
    text = engine.metrics()
    assert metric(text, "tandem:prefix_cache_hits_total") > 0
    assert metric(text, "tandem:prefix_cache_queries_total") >= metric(
        text, "tandem:prefix_cache_hits_total"
    )
    assert metric(text, "tandem:kv_cache_usage_perc") == 0


# --- (c) churn: abandoned streams, invalid requests ---------------------------------------------
def test_abandoned_and_invalid_requests_leak_no_blocks(engine, greedy):
    errors, done = [], []

    def abandon(i: int) -> None:
        try:
            stream = engine.stream(
                prompt_token_ids=COMMON + [10 + i, 11 + i, 12 + i], max_new_tokens=90
            )
            for n, _ in enumerate(stream):
                if n == 1 + i % 3:
                    break  # the generator is dropped: a cancel goes out
            del stream
            done.append(("abandoned", i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def invalid(kwargs: dict) -> None:
        try:
            with pytest.raises(ValueError):
                engine.generate(**kwargs)
            done.append(("invalid", str(kwargs)[:40]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def complete(i: int) -> None:
        try:
            prompt = COMMON[: 12 + 5 * i] + [60 + i]
            out = engine.generate(prompt_token_ids=prompt, max_new_tokens=30)
            if out.token_ids != greedy(prompt, 30):
                errors.append(AssertionError(f"complete({i}): not greedy"))
            done.append(("complete", i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    cancelled = metric(engine.metrics(), CANCELLED)
    bad = [
        {"prompt_token_ids": COMMON + [10**6], "max_new_tokens": 5},  # out of vocab
        {"prompt": "no tokenizer here", "max_new_tokens": 5},  # refused by server
        {"prompt_token_ids": COMMON, "max_new_tokens": 5, "top_p": 0.0},
    ]
    threads = [threading.Thread(target=abandon, args=(i,)) for i in range(5)]
    threads += [threading.Thread(target=invalid, args=(kw,)) for kw in bad]
    threads += [threading.Thread(target=complete, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(done) == 11
    stats = wait_idle(engine)
    assert stats["kv_blocks_used"] == 0
    # abandoned streams were cancelled while they ran (holding blocks), not run to the end
    assert metric(engine.metrics(), CANCELLED) > cancelled
    # then a full batch is exact
    prompts = [COMMON + t for t in TAILS]
    outs = engine.generate(prompt_token_ids=prompts, max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == [greedy(p, NEW) for p in prompts]
    assert wait_idle(engine)["kv_blocks_used"] == 0


# --- (b) preemption ----------------------------------------------------------------------------
def test_a_tiny_pool_preempts_and_stays_exact(pair, greedy, tmp_path):
    """A KV pool just above one request of max_seq_len and 4 concurrent long generations:
    requests are preempted and readmitted, their outputs still the target's greedy ones."""
    same = (("cpu:0",), ("cpu:0",))  # one worker rank, no overlap
    probe = write(tmp_path, pair, same, max_seq_len=96, max_batch_size=4)
    per_request = -(-load_config(probe).kv_seq_len // BLOCK) * BLOCK
    cfg = write(
        tmp_path,
        pair,
        same,
        max_seq_len=96,
        max_batch_size=4,
        kv_cache_tokens=per_request + 2 * BLOCK,
    )
    assert load_config(cfg).runtime.kv_cache_tokens == per_request + 2 * BLOCK
    # (prompts whose greedy continuations hold no EOS within `new` tokens)
    prompts = [[1, 5 + i, 9, 13 + 2 * i, 17, 21, 25 + i, 30] for i in (0, 1, 3, 7)]
    new = 60
    with Engine.launch(cfg) as eng:
        assert eng.stats()["kv_blocks_total"] == per_request // BLOCK + 2
        outs = eng.generate(prompt_token_ids=prompts, max_new_tokens=new)
        stats = wait_idle(eng)
        text = eng.metrics()
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == greedy(prompt, new)
    assert all(len(o.token_ids) == new for o in outs)  # no EOS: all long generations
    assert stats["num_preemptions"] > 0
    assert sum(o.stats["preemptions"] for o in outs) == stats["num_preemptions"]
    assert stats["kv_blocks_used"] == 0
    assert metric(text, "tandem:num_preemptions_total") == stats["num_preemptions"]


# --- (d) sampled tokens do not depend on prefix hits ---------------------------------------------
SAMPLE_PROMPTS = [COMMON + [77, 78], COMMON + [5, 6, 7]]


def sampled_runs(eng: Engine) -> list:
    """Each sampled request twice, one after the other: the second finds its prompt cached
    when prefix caching is on."""
    return [eng.generate(prompt_token_ids=p, **SAMPLED) for p in SAMPLE_PROMPTS for _ in "12"]


def test_prefix_hits_do_not_change_sampled_tokens(engine, pair, greedy, tmp_path):
    on = sampled_runs(engine)
    assert on[1].stats["cached_prompt_tokens"] == (len(SAMPLE_PROMPTS[0]) - 1) // BLOCK * BLOCK
    assert on[3].stats["cached_prompt_tokens"] == (len(SAMPLE_PROMPTS[1]) - 1) // BLOCK * BLOCK
    assert on[0].token_ids == on[1].token_ids and on[2].token_ids == on[3].token_ids
    # really sampled: not the greedy continuation
    assert any(
        o.token_ids != greedy(p, SAMPLED["max_new_tokens"]) for o, p in zip(on[::2], SAMPLE_PROMPTS)
    )
    with Engine.launch(write(tmp_path, pair, prefix_caching=False)) as eng:
        off = sampled_runs(eng)
        stats = wait_idle(eng)
    assert all(o.stats["cached_prompt_tokens"] == 0 for o in off)
    assert stats["prefix_cache_hit_rate"] == 0 and stats["kv_blocks_used"] == 0
    assert [o.token_ids for o in off] == [o.token_ids for o in on]


# --- TP on both sides: every rank of a group reports what it caches --------------------------
def test_prefix_hits_with_tensor_parallel_on_both_sides(pair, greedy, tmp_path):
    """Draft at TP 2 and target at TP 2 (four worker ranks, each with its heads' share of the
    pool): prefix hits stay greedy-exact and no block leaks."""
    cfg = write(tmp_path, pair, devices=(("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")))
    with Engine.launch(cfg) as eng:
        first = eng.generate(prompt_token_ids=COMMON + TAILS[0], max_new_tokens=NEW)
        rest = eng.generate(prompt_token_ids=[COMMON + t for t in TAILS[1:3]], max_new_tokens=NEW)
        assert first.token_ids == greedy(COMMON + TAILS[0], NEW)
        for out, tail in zip(rest, TAILS[1:3]):
            assert out.token_ids == greedy(COMMON + tail, NEW)
            assert out.stats["cached_prompt_tokens"] == len(COMMON) // BLOCK * BLOCK
        assert wait_idle(eng)["kv_blocks_used"] == 0


# --- chunked prefill: prompts over several steps, beside running streams ----------------------
def test_chunked_prefill_stays_greedy_exact(pair, greedy, tmp_path):
    """runtime.max_prefill_tokens 3: prompts are prefilled 3 tokens a step past their prefix
    hits, the stream's own while nothing decodes too, the others' while it decodes; all
    greedy-exact, nothing leaked."""
    cfg = write(tmp_path, pair, max_prefill_tokens=3)
    with Engine.launch(cfg) as eng:
        stream = eng.stream(prompt_token_ids=COMMON + TAILS[0], max_new_tokens=80)
        got = list(next(stream).token_ids)  # decoding now
        prompts = [COMMON + t for t in TAILS[1:]]
        outs = eng.generate(prompt_token_ids=prompts, max_new_tokens=NEW)
        for out, prompt in zip(outs, prompts):
            assert out.token_ids == greedy(prompt, NEW)
            assert out.stats["cached_prompt_tokens"] == len(COMMON) // BLOCK * BLOCK
        for delta in stream:
            got += delta.token_ids
        assert got == greedy(COMMON + TAILS[0], 80)
        assert wait_idle(eng)["kv_blocks_used"] == 0
