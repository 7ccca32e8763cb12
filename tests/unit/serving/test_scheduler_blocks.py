"""The scheduler's KV blocks (runtime.serving.scheduler.Scheduler with a BlockManager) against
simulated workers (tests/serving_sim.py): prefix hits, preemption, cancellation, what every
rank caches, churn and chunked prefill, every request's tokens exact."""

from __future__ import annotations

import random

import pytest

from runtime.serving.scheduler import Sequence
from runtime.serving.sequence import SeqStatus
from tests.serving_sim import (
    BS,
    DRAFT_LEN,
    MAX_SEQ_LEN,
    VOCAB,
    Run,
    assert_exact,
    make_seq,
)

pytestmark = pytest.mark.timeout(120)

SYSTEM = [7000 + i for i in range(22)]  # 5 full blocks and 2 tokens


def user(i: int, n: int = 5) -> list[int]:
    return [100 * (i + 1) + j for j in range(n)]


# --- prefix hits ------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_len", [DRAFT_LEN, None], ids=["k3", "auto"])
def test_shared_system_prompt_hits(draft_len):
    run = Run(num_blocks=200, draft_len=draft_len)
    first = run.add(make_seq("r0", SYSTEM + user(0), 20))
    run.step()  # the first one prefills and runs a round
    later = [run.add(make_seq(f"r{i}", SYSTEM + user(i), 20)) for i in range(1, 4)]
    run.drain()
    assert_exact(run, [first] + later)
    assert first.stats.cached_prompt_tokens == 0
    shared_blocks = len(SYSTEM) // BS
    for seq in later:
        assert seq.stats.cached_prompt_tokens == shared_blocks * BS
        assert seq.output()["stats"]["cached_prompt_tokens"] == shared_blocks * BS
    fed = {tuple(p["prompt"]): p["fed"] for p in run.workers.prefills}
    assert fed[tuple(first.prompt_ids)] == len(first.prompt_ids) - 1
    for seq in later:  # the prefill sends fewer tokens
        assert fed[tuple(seq.prompt_ids)] == len(seq.prompt_ids) - 1 - shared_blocks * BS
    snap = run.sched.metrics.snapshot(0, 0, run.blocks.num_blocks, run.blocks.used)
    assert snap["kv_blocks_used"] == 0
    queried = sum(len(s.prompt_ids) for s in [first] + later)
    assert snap["prefix_cache_hit_rate"] == pytest.approx(3 * shared_blocks * BS / queried)
    assert snap["num_preemptions"] == 0
    run.check_idle()


def test_a_repeated_prompt_hits_all_its_full_blocks_but_feeds_its_last_token():
    """A prompt seen before, whole: every full block is a hit except one holding the last
    token (which is fed, not cached); and a prompt of whole blocks matches one block less."""
    run = Run(num_blocks=200)
    prompt = SYSTEM + user(0, 6)  # 28 tokens: 7 full blocks
    a = run.add(make_seq("a", prompt, 8))
    run.drain()
    b = run.add(make_seq("b", prompt, 8))
    run.drain()
    assert b.stats.cached_prompt_tokens == 24  # block 7 holds the last token
    assert run.workers.prefills[-1]["fed"] == 27 - 24
    c = run.add(make_seq("c", prompt + [5], 8))
    run.drain()
    assert c.stats.cached_prompt_tokens == 28
    assert_exact(run, [a, b, c])
    run.check_idle()


def test_generated_tokens_are_hits_for_a_follow_up_turn():
    """A second turn (prompt + the first turn's output + a new message) finds the blocks of
    the first turn's generated tokens too: they were registered as they were committed."""
    run = Run(num_blocks=200)
    first = run.add(make_seq("t1", SYSTEM + user(0), 30))
    run.drain()
    follow = SYSTEM + user(0) + first.generated + user(9, 3)
    second = run.add(make_seq("t2", follow, 10))
    run.drain()
    committed = len(SYSTEM + user(0)) + 30
    # every full block of the first turn's committed tokens whose KV was cached: all but
    # the last token's (pending when it finished)
    assert second.stats.cached_prompt_tokens == ((committed - 1) // BS) * BS
    assert second.stats.cached_prompt_tokens > len(SYSTEM + user(0))
    assert_exact(run, [first, second])
    run.check_idle()


def test_prefix_caching_off_never_hits():
    run = Run(num_blocks=200, prefix_caching=False)
    first = run.add(make_seq("r0", SYSTEM + user(0), 12))
    run.step()
    later = [run.add(make_seq(f"r{i}", SYSTEM + user(i), 12)) for i in range(1, 4)]
    run.drain()
    assert_exact(run, [first] + later)
    assert all(s.stats.cached_prompt_tokens == 0 for s in [first] + later)
    assert all(p["cached"] == 0 for p in run.workers.prefills)
    assert not run.blocks.index
    run.check_idle()


# --- preemption -------------------------------------------------------------------------------
def pool_for_one(draft_len: int | None = DRAFT_LEN) -> int:
    """Blocks of the least pool a config accepts: one request of MAX_SEQ_LEN
    (TandemConfig.check_kv_pool; draft_len None: auto, at most 8)."""
    return -(-(MAX_SEQ_LEN + (draft_len or 8) + 2) // BS)


def queued(run: Run, seq: Sequence) -> bool:
    return any(q is seq for q in run.sched.queue)


def long_requests(n: int = 6, max_new: int = 90, name: str = "p") -> list[Sequence]:
    return [make_seq(f"{name}{i}", SYSTEM[:10] + user(i, 7), max_new) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("draft_len", [DRAFT_LEN, None], ids=["k3", "auto"])
def test_small_pool_preempts_and_every_request_finishes_exactly(seed, draft_len):
    small = Run(num_blocks=pool_for_one(draft_len) + 4, draft_len=draft_len, seed=seed)
    seqs = [small.add(s) for s in long_requests()]
    small.drain()
    big = Run(num_blocks=1000, draft_len=draft_len, seed=seed + 10)
    ref = [big.add(s) for s in long_requests()]
    big.drain()
    assert big.sched.metrics.preemptions == 0
    assert small.sched.metrics.preemptions > 0
    assert sum(s.stats.preemptions for s in seqs) == small.sched.metrics.preemptions
    assert_exact(small, seqs)
    assert [s.generated for s in seqs] == [s.generated for s in ref]
    assert all(len(s.generated) == 90 for s in seqs)
    # a readmission is a prefix hit of its own committed blocks, not a prompt's hit
    readmitted = [p for p in small.workers.prefills if p["cached"] > 0]
    assert readmitted
    for seq in seqs:
        assert seq.stats.cached_prompt_tokens <= len(seq.prompt_ids)
    small.check_idle()
    big.check_idle()


def test_preemption_takes_the_newest():
    """The newest is preempted, and waits first in line (prompts without a common prefix: a
    shared prefix registered twice is deduplicated when the newest is readmitted, which may
    then fit at once)."""
    run = Run(num_blocks=pool_for_one() + 2, num_slots=2)
    old, new = [run.add(make_seq(f"p{i}", user(i, 17), 90)) for i in range(2)]
    while not run.sched.metrics.preemptions:
        run.step()
    assert new.stats.preemptions == 1 and old.stats.preemptions == 0
    assert run.sched.queue[0] is new and new.slot is None and old.slot is not None
    run.drain()
    assert_exact(run, [old, new])
    run.check_idle()


# --- cancellation -----------------------------------------------------------------------------
def test_cancel_running_queued_and_preempted_leaks_nothing():
    run = Run(num_blocks=pool_for_one() + 4, num_slots=3)
    seqs = [run.add(s) for s in long_requests(6)]
    # run until a preempted request waits in the queue
    while not any(s.stats.preemptions and queued(run, s) for s in seqs):
        run.step()
    preempted = next(s for s in seqs if s.stats.preemptions and queued(run, s))
    assert preempted.generated  # it ran before it was preempted
    running = next(iter(run.sched.running.values()))
    never = next(s for s in seqs if queued(run, s) and not s.stats.preemptions and not s.generated)
    for seq in (preempted, running, never):
        run.sched.cancel(seq.request_id)
    run.drain()
    cancelled = {preempted.request_id, running.request_id, never.request_id}
    assert running.finish_reason == "cancelled"
    assert not queued(run, preempted) and not queued(run, never)
    assert len(preempted.generated) < preempted.params.max_new_tokens
    assert not never.generated
    rest = [s for s in seqs if s.request_id not in cancelled]
    assert_exact(run, rest)
    run.check_idle()


def test_cancel_everything_at_once_leaks_nothing():
    run = Run(num_blocks=pool_for_one() + 4, num_slots=3)
    seqs = [run.add(s) for s in long_requests(6)]
    for _ in range(25):
        run.step()
    for seq in seqs:
        run.sched.cancel(seq.request_id)
    run.drain()
    run.check_idle()
    # the cache keeps what was committed: a rerun of the same prompts hits and is exact
    again = [run.add(s) for s in long_requests(2, max_new=20, name="again")]
    run.drain()
    assert_exact(run, again)
    assert again[0].stats.cached_prompt_tokens > 0
    run.check_idle()


# --- only what every rank caches is indexed ------------------------------------------------------
@pytest.mark.parametrize("lag", [(0, 3), (0, 9), (2, 0, 5)])
def test_lagging_cached_reports_bound_the_index(lag):
    """One rank reports fewer cached positions than the others (its cache behind): nothing
    past the least report is ever indexed (check_books after every step: every indexed block
    is wholly cached on every rank and holds its key's tokens; no table keys past what was
    reported), and prefix hits stay right."""
    run = Run(num_blocks=300, lag=lag, accept=0.5)
    first = run.add(make_seq("r0", SYSTEM + user(0), 40))
    run.step()
    later = [run.add(make_seq(f"r{i}", SYSTEM + user(i), 40)) for i in range(1, 3)]
    run.drain()
    assert_exact(run, [first] + later)
    # the system prompt's blocks as far as the least report of the first round went
    reach = (len(SYSTEM + user(0)) + 1 - max(lag)) // BS * BS
    assert all(s.stats.cached_prompt_tokens == min(reach, len(SYSTEM) // BS * BS) for s in later)
    follow = run.add(make_seq("f", first.tokens, 5))
    run.drain()
    # the first's generated tokens were indexed only as far as the least report went
    known = next(
        n for tokens, n in run.workers.released if tokens[: len(first.tokens)] == first.tokens
    )
    assert follow.stats.cached_prompt_tokens == min(known, len(first.tokens) - 1) // BS * BS
    assert follow.stats.cached_prompt_tokens > len(SYSTEM)
    assert_exact(run, [follow])
    run.check_idle()


def test_no_reported_cached_indexes_nothing():
    """Replies that report no cached positions at all (an empty `cached`, prefills' too):
    nothing is indexed, so nothing is ever a hit, and every request is still exact."""

    run = Run(num_blocks=200, silent=True)
    seq = run.add(make_seq("r0", SYSTEM + user(0), 30))
    run.drain()
    assert not run.blocks.index
    follow = run.add(make_seq("f", SYSTEM + user(0) + seq.generated, 4))
    run.drain()
    assert follow.stats.cached_prompt_tokens == 0
    assert_exact(run, [seq, follow])
    run.check_idle()


# --- churn --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_cancels_and_small_pool(seed):
    """Requests arrive at random steps, some sharing prefixes, some cancelled at random (queued,
    running or preempted); every one not cancelled ends exact, nothing leaks."""
    rng = random.Random(seed)
    run = Run(
        num_blocks=pool_for_one() + rng.randrange(0, 30),
        num_slots=rng.choice([2, 4]),
        draft_len=rng.choice([1, 3, None]),
        seed=seed,
        lag=rng.choice([(0,), (0, 2)]),
        max_prefill_tokens=[None, 2, 7, 16][seed],
    )
    prefixes = [SYSTEM[:n] for n in (0, 9, 22)]
    pending = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        pending.append((rng.randrange(0, 120), make_seq(f"c{i}", prompt, rng.randrange(1, 100))))
    cancelled = set()
    seqs = []
    while pending or run.sched.has_work:
        for at, seq in [p for p in pending if p[0] <= run.steps]:
            seqs.append(run.add(seq))
            pending.remove((at, seq))
        if seqs and rng.random() < 0.03:
            victim = rng.choice(seqs)
            if victim.finish_reason is None:
                run.sched.cancel(victim.request_id)
                cancelled.add(victim.request_id)
        run.step()
    assert_exact(run, [s for s in seqs if s.request_id not in cancelled])
    run.check_idle()


# --- chunked prefill (runtime.max_prefill_tokens) ------------------------------------------------
@pytest.mark.parametrize("budget", [2, 8, 33])
def test_a_long_prompt_is_prefilled_in_chunks_while_another_stream_decodes(budget):
    """A long prompt arriving while a stream decodes is prefilled `budget` tokens a step; the
    stream gets a round, and tokens, after every chunk; both end exact, with no block left."""
    run = Run(num_blocks=400, max_prefill_tokens=budget)
    steady = run.add(make_seq("steady", user(0), 100))  # decodes past the long prefill
    while steady.status is not SeqStatus.RUNNING:  # alone, its prompt is chunked too
        run.step()
    length = min(120, 20 * budget)  # 20 steps at most: the stream outlasts them
    long = run.add(make_seq("long", [9000 + i for i in range(length)], 12))
    sizes, gaps = [], 0
    while long.status is not SeqStatus.RUNNING or long.slot is None:
        before = len(steady.generated)
        prefills = len(run.workers.prefills)
        run.step()
        sizes += [len(p["prompt"]) - p["cached"] for p in run.workers.prefills[prefills:]]
        gaps += len(steady.generated) == before and steady.finish_reason is None
    run.drain()
    assert_exact(run, [steady, long])
    assert len(sizes) >= length // budget and max(sizes) <= budget  # chunks within the budget
    assert gaps == 0  # the stream never waited a whole step
    run.check_idle()


def test_chunks_resume_after_a_prefix_hit_and_preemption():
    """Chunks start past a prefix hit; a prompt preempted halfway is prefilled again from
    its cached blocks; everything exact, nothing leaked."""
    run = Run(num_blocks=pool_for_one() + 12, max_prefill_tokens=6)
    first = run.add(make_seq("a", SYSTEM + user(0), 40))
    run.drain()
    later = [run.add(make_seq(f"b{i}", SYSTEM + user(i), 60)) for i in range(1, 4)]
    run.drain()
    assert_exact(run, [first] + later)
    assert all(s.stats.cached_prompt_tokens == len(SYSTEM) // BS * BS for s in later)
    assert any(p["cached"] > 0 and not p["final"] for p in run.workers.prefills)
    run.check_idle()


@pytest.mark.parametrize("budget", [None, 2, 8, 13])
def test_an_idle_scheduler_prefills_long_prompts_within_the_budget(budget):
    """With nothing decoding the budget bounds every step too: two 40-token prompts reaching an
    idle scheduler are prefilled at most `budget` tokens a step, in admission order (None, a
    Scheduler built without a budget: whole, both in one step); the first decodes, a round
    after every chunk of the second, as soon as its prompt is done; both end exact."""
    run = Run(num_blocks=400, max_prefill_tokens=budget)
    first, second = [
        run.add(make_seq(f"a{i}", [7000 + 50 * i + j for j in range(40)], 60)) for i in range(2)
    ]
    steps = []  # per step: [(which prompt, tokens sent)], whether `first` got tokens (or
    while second.status is not SeqStatus.RUNNING:  # had ended)
        done, before = len(run.workers.prefills), len(first.generated)
        ended = first.finish_reason is not None
        run.step()
        steps.append(
            (
                [
                    (p["prompt"][0], len(p["prompt"]) - p["cached"])
                    for p in run.workers.prefills[done:]
                ],
                ended or len(first.generated) > before,
            )
        )
    chunks = [c for chunk, _ in steps for c in chunk]
    if budget is None:
        assert chunks == [(7000, 40), (7050, 40)] and len(steps) == 1
    else:
        assert all(sum(n for _, n in chunk) <= budget for chunk, _ in steps)
        assert len(steps) >= 80 // budget
        assert [which for which, _ in chunks] == sorted(which for which, _ in chunks)
        assert sum(n - 1 for _, n in chunks) == 2 * 39  # a chunk's last token starts the next
        first_done = max(
            i for i, (chunk, _) in enumerate(steps) if any(which == 7000 for which, _ in chunk)
        )
        assert all(got for _, got in steps[first_done:])  # a round after every chunk
    run.drain()
    assert_exact(run, [first, second])
    run.check_idle()
