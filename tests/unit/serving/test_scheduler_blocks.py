"""The scheduler's KV blocks (runtime.serving.scheduler.Scheduler with a BlockManager) against
fake workers that simulate what real ones do with the blocks.

FakeWorkers keeps, from the prefill/round/release commands alone, each slot's committed tokens,
its cache length and its block table, and what every block's KV holds (one token per position,
as the model's K/V would). It checks every command with commands.command, that no slot writes
outside its table or into a block another slot holds or the prefix index serves, that a round's
tables address what the round may write, and that a prefill's `cached` positions are exactly
blocks whose contents are the new prompt's tokens (so a prefix hit is correct). The target is
deterministic (next token = f(tokens before it)), so a request's tokens do not depend on how it
was scheduled: preempted, readmitted from a prefix hit, or run alone. Rejected drafts are written
into the KV as garbage, as real ones are, and positions count as known-cached only once every
rank's RoundReply.cached covers them."""
from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from runtime.control import commands, protocol
from runtime.params import SamplingParams
from runtime.serving.block_manager import ROOT, BlockManager, chain_key
from runtime.serving.scheduler import Scheduler, Sequence, round_lookahead
from runtime.serving.textstream import TextStream
from runtime.speculation.adaptive import TARGET_ONLY_STEPS

pytestmark = pytest.mark.timeout(120)

BS = 4                 # positions per KV block
VOCAB = 50_000
MAX_SEQ_LEN = 160
DRAFT_LEN = 3


def next_token(tokens: list[int]) -> int:
    """The fake target's greedy token after `tokens` (depends on all of them)."""
    digest = hashlib.blake2b(array("q", tokens[-12:]).tobytes() + len(tokens).to_bytes(4, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def truth(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


GARBAGE = -1           # what a rejected draft (or a draft drafted ahead) leaves in the KV


class Slot:
    def __init__(self, tokens: list[int], table: list[int], cache_len: int):
        self.tokens = list(tokens)     # committed (may run past max_new_tokens, as real ones)
        self.table = list(table)
        self.cache_len = cache_len     # positions holding committed tokens' KV


class FakeWorkers:
    """Stands in for the WorkerPool: `ranks` workers, the first the target leader; rank r > 0
    reports `cached` lagging by lag[r] positions (a rank whose cache is behind)."""

    def __init__(self, num_blocks: int, num_slots: int, table_len: int, draft_len_max: int,
                 seed: int = 0, lag: tuple[int, ...] = (0,), accept: float = 0.6,
                 silent: bool = False):
        self.num_blocks, self.num_slots, self.table_len = num_blocks, num_slots, table_len
        self.lookahead = round_lookahead(draft_len_max, False)
        self.rng = random.Random(seed)
        self.lag, self.accept = lag, accept
        self.silent = silent     # replies report no cached positions at all (an empty list)
        self.slots: dict[int, Slot] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.confirmed: dict[int, list[bool]] = {}   # per block position: every rank caches it
        self.named: dict[bytes, list[int]] = {}      # chain key -> its block's tokens
        self.sched: Scheduler | None = None
        self.prefills: list[dict] = []               # per prefilled sequence: prompt, cached
        self.rounds = self.step = 0
        self.max_reported: dict[int, int] = {}       # slot -> the most positions known cached
        self.released: list[tuple[list[int], int]] = []   # (tokens, max_reported) at release

    # --- the pool's interface -----------------------------------------------------------------
    def command(self, msg: dict, timeout_s: float) -> dict[int, dict]:
        self.step += 1                            # as WorkerPool.command stamps it
        msg = protocol.decode(protocol.encode(dict(msg, step=self.step)))   # through msgpack
        cmd = commands.command(msg)
        if isinstance(cmd, commands.PrefillCommand):
            return self._prefill(cmd)
        if isinstance(cmd, commands.ReleaseCommand):
            for slot in cmd.slots:
                if slot not in self.slots:      # admitted, ended before its first chunk
                    assert slot in self.sched.running, f"release of slot {slot}, never run"
                    continue
                self.released.append((self.slots.pop(slot).tokens,
                                      self.max_reported.pop(slot)))
            return self._acks()
        return self._round(cmd)

    def _acks(self) -> dict[int, dict]:
        return {rank: commands.StepAck().to_map() for rank in range(len(self.lag))}

    # --- prefill --------------------------------------------------------------------------------
    def _prefill(self, cmd: commands.PrefillCommand) -> dict[int, dict]:
        """Each slot's tokens from `cached` on (checked against the scheduler's sequence):
        a chunk caches all but its last token; a prompt's end is cached whole by both models
        (the target picks the first output token): every rank reports that."""
        assert len(cmd.tables) == len(cmd.slots)
        report = []
        for slot, part, cached, table, final in zip(cmd.slots, cmd.prompts, cmd.cached,
                                                    cmd.tables, cmd.final):
            tokens = self.sched.running[slot].tokens
            assert part == tokens[cached:cached + len(part)] and len(part) >= 1
            assert final == (cached + len(part) == len(tokens)) and (final or len(part) >= 2)
            prompt = tokens[:cached + len(part)]
            self._start(slot, prompt, cached, table)
            self._write(slot, range(cached, len(prompt) - (0 if final else 1)), prompt)
            if final:
                self.slots[slot].tokens += truth(prompt, 1)
            self.slots[slot].cache_len = len(prompt) - (0 if final else 1)
            self.prefills.append({"prompt": list(prompt), "cached": cached,
                                  "fed": len(prompt) - 1 - cached, "final": final})
            report.append(len(prompt) - (0 if final else 1))   # a prompt's end: all of it
        replies = {}
        for rank, lag in enumerate(self.lag):
            cached = [] if self.silent else [max(0, c - lag) for c in report]
            if rank == 0:
                firsts = [self.slots[s].tokens[-1:] if f else [] for s, f in
                          zip(cmd.slots, cmd.final)]
                reply = commands.RoundReply(commands.TARGET_LEADER, 0.001, cached=cached,
                                            tokens=firsts, accepted=[0] * len(cmd.slots))
            else:
                reply = commands.RoundReply(commands.WORKER, 0.001, cached=cached)
            replies[rank] = reply.to_map()
        for slot, upto in zip(cmd.slots, report):
            known = 0 if self.silent else min(max(0, upto - lag) for lag in self.lag)
            self._confirm(slot, known)
            self.max_reported[slot] = max(self.max_reported.get(slot, 0), known)
        return replies

    def _start(self, slot: int, prompt: list[int], cached: int, table: list[int]) -> None:
        """A prefill's checks of the slot's table and cached positions; a new sequence's
        Slot (a later chunk's is the same, its table grown)."""
        assert 0 <= slot < self.num_slots, slot
        assert len(set(table)) == len(table), f"slot {slot}: a block twice in {table}"
        assert all(0 <= b < self.num_blocks for b in table)
        if slot in self.slots:        # a later chunk: where the last one stopped
            assert self.slots[slot].cache_len == cached and self.slots[slot].table == table
            self.slots[slot].tokens = list(prompt)
            return
        assert cached % BS == 0 and 0 <= cached < len(prompt)
        # the prefix hit: every cached position is known on every rank to hold the prompt's
        # token there
        for p in range(cached):
            block, off = table[p // BS], p % BS
            assert self.confirmed.get(block, [False] * BS)[off], \
                f"slot {slot}: position {p} (block {block}) sent as cached, never cached"
            assert self.kv[block][off] == prompt[p], \
                f"slot {slot}: a prefix hit on block {block} holding other tokens"
        # blocks past the hit are this slot's alone; shared ones are whole cached blocks
        holders = self._holders()
        for i, block in enumerate(table):
            if i >= cached // BS:
                assert block not in holders, \
                    f"slot {slot}: block {block} is slot {holders.get(block)}'s too"
        full = len(self.sched.running[slot].tokens)
        assert len(table) * BS >= min(full + 1 + self.lookahead, self.table_len), \
            f"slot {slot}: a table of {len(table) * BS} positions for {full} tokens"
        self.slots[slot] = Slot(prompt, table, cached)

    # --- rounds -----------------------------------------------------------------------------
    def _round(self, cmd: commands.RoundCommand) -> dict[int, dict]:
        self.rounds += 1
        assert cmd.slots == sorted(set(cmd.slots)) and set(cmd.slots) <= set(self.slots)
        assert len(cmd.tables) == len(cmd.slots)
        holders = self._holders()
        for slot, new in zip(cmd.slots, cmd.tables):
            for block in new:   # new blocks are nobody's (free, or evicted from the cache)
                assert 0 <= block < self.num_blocks
                assert block not in holders, f"slot {slot} grows by block {block}, held by " \
                                             f"slot {holders[block]}"
                holders[block] = slot
            self.slots[slot].table.extend(new)
        tokens, accepted, cached = [], [], []
        for slot in cmd.slots:
            s = self.slots[slot]
            committed = len(s.tokens)
            assert s.cache_len == committed - 1
            need = min(committed + self.lookahead, self.table_len)
            assert len(s.table) * BS >= need, \
                f"slot {slot}: {len(s.table) * BS} positions for a round at {committed}"
            if cmd.k == 0:       # target-only: `steps` decode steps, all committed
                new = truth(s.tokens, cmd.steps)
                s.tokens += new
                self._write(slot, range(committed - 1, committed - 1 + cmd.steps), s.tokens)
                tokens.append(new)
                accepted.append(0)
            else:                # verify pending + k drafts; `a` drafts right, the rest not
                a = 0
                while a < cmd.k and self.rng.random() < self.accept:
                    a += 1
                new = truth(s.tokens, a + 1)
                s.tokens += new
                self._write(slot, range(committed - 1, committed + a), s.tokens)
                self._write(slot, range(committed + a, committed + cmd.k), None)   # rejected
                tokens.append(new)
                accepted.append(a)
            s.cache_len = len(s.tokens) - 1
            # the next round's first work, done ahead (drafts: KV of tokens not committed)
            ahead = cmd.next_k if cmd.next_k > 0 else 1
            end = min(s.cache_len + ahead + 1, len(s.table) * BS)
            self._write(slot, range(s.cache_len, end), None)
            cached.append(s.cache_len)
        replies = {}
        for rank, lag in enumerate(self.lag):
            report = [] if self.silent else [max(0, c - lag) for c in cached]
            if rank == 0:
                reply = commands.RoundReply(commands.TARGET_LEADER, 0.001 * (cmd.k + 1),
                                            tokens=tokens, accepted=accepted, cached=report)
            else:
                reply = commands.RoundReply(commands.WORKER, 0.001, cached=report)
            replies[rank] = reply.to_map()
        known = [0 if self.silent else min(max(0, c - lag) for lag in self.lag)
                 for c in cached]
        for slot, upto in zip(cmd.slots, known):
            self._confirm(slot, upto)
            self.max_reported[slot] = max(self.max_reported.get(slot, 0), upto)
        return replies

    # --- KV -----------------------------------------------------------------------------------
    def _holders(self) -> dict[int, int]:
        return {b: slot for slot, s in self.slots.items() for b in s.table}

    def _write(self, slot: int, positions, tokens: list[int] | None) -> None:
        """KV written at `positions` of the slot (tokens None: garbage, not committed)."""
        s = self.slots[slot]
        books = self.sched.blocks if self.sched else None
        for p in positions:
            assert p < len(s.table) * BS, f"slot {slot} writes position {p} past its table"
            block = s.table[p // BS]
            others = [o for o, t in self.slots.items() if o != slot and block in t.table]
            assert not others, f"slot {slot} writes block {block}, held by slots {others}"
            assert books is None or books.key_of[block] is None, \
                f"slot {slot} writes into block {block}, which the prefix index serves"
            self.kv.setdefault(block, [None] * BS)[p % BS] = GARBAGE if tokens is None \
                else tokens[p]
            self.confirmed.setdefault(block, [False] * BS)[p % BS] = False

    def _confirm(self, slot: int, upto: int) -> None:
        """Every rank caches the slot's committed KV below `upto`."""
        s = self.slots[slot]
        parent = ROOT
        for p in range(upto):
            block = s.table[p // BS]
            assert self.kv[block][p % BS] == s.tokens[p], \
                f"slot {slot}: position {p} reported cached holds {self.kv[block][p % BS]}"
            self.confirmed[block][p % BS] = True
        for start in range(0, upto - BS + 1, BS):
            parent = chain_key(parent, s.tokens[start:start + BS])
            self.named[parent] = s.tokens[start:start + BS]

    # --- checks after a step -----------------------------------------------------------------
    def check_books(self) -> None:
        sched = self.sched
        blocks = sched.blocks
        assert set(self.slots) <= set(sched.running)
        held = set()
        for slot, seq in sched.running.items():
            if slot not in self.slots:     # admitted, its first chunk not sent yet
                assert not seq.ready
                held.update(seq.table.blocks)
                continue
            assert seq.table.blocks == self.slots[slot].table
            mine = self.slots[slot].tokens          # a prompt in chunks: its part so far
            assert mine[:len(seq.tokens)] == seq.tokens[:len(mine)]
            held.update(seq.table.blocks)
            # a table's indexed leading blocks: never past what every rank reported cached
            reported = self.max_reported[slot]
            assert len(seq.table.keys) * BS <= reported, \
                f"slot {slot}: {len(seq.table.keys)} blocks keyed, {reported} positions cached"
        assert blocks.used == len(held)
        assert sum(blocks.refs) == sum(len(s.table.blocks) for s in sched.running.values())
        for key, block in blocks.index.items():
            assert blocks.key_of[block] == key
            assert all(self.confirmed[block]), f"indexed block {block} is not all cached"
            assert key in self.named and self.kv[block] == self.named[key], \
                f"indexed block {block} holds {self.kv[block]}, not its key's tokens"


# --- driving --------------------------------------------------------------------------------
def make_seq(rid: str, prompt: list[int], max_new: int, index: int = 0) -> Sequence:
    return Sequence(rid, index, list(prompt), SamplingParams.from_kwargs(max_new_tokens=max_new),
                    TextStream(None))


class Run:
    def __init__(self, num_blocks: int, num_slots: int = 4, draft_len: int | None = DRAFT_LEN,
                 prefix_caching: bool = True, seed: int = 0, lag: tuple[int, ...] = (0,),
                 accept: float = 0.6, silent: bool = False,
                 max_prefill_tokens: int | None = None):
        table_len = MAX_SEQ_LEN + (draft_len or 8) + 2          # TandemConfig.kv_seq_len
        self.blocks = BlockManager(num_blocks, BS, prefix_caching)
        self.workers = FakeWorkers(num_blocks, num_slots, table_len,
                                   draft_len if draft_len is not None else 8, seed, lag, accept,
                                   silent)
        self.sched = Scheduler(self.workers, num_slots, draft_len, eos_token_ids=(),
                               step_timeout_s=5.0, blocks=self.blocks, table_len=table_len,
                               max_prefill_tokens=max_prefill_tokens)
        self.workers.sched = self.sched
        self.finals: list[Sequence] = []
        self.deltas: dict[str, list[int]] = {}
        self.steps = 0

    def add(self, seq: Sequence) -> Sequence:
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        for event in self.sched.step():
            key = f"{event.seq.request_id}/{event.seq.index}"
            if event.kind == "delta":
                self.deltas.setdefault(key, []).extend(event.token_ids)
            else:
                self.finals.append(event.seq)
        self.workers.check_books()
        self.steps += 1
        assert self.steps < 5000, "the scheduler makes no progress"

    def drain(self) -> None:
        while self.sched.has_work:
            self.step()

    def check_idle(self) -> None:
        assert not self.sched.running and not self.sched.queue
        assert not self.workers.slots, "a slot never released"
        assert self.blocks.used == 0 and sum(self.blocks.refs) == 0
        assert self.blocks.available == self.blocks.num_blocks
        assert sorted(self.sched.free_slots) == list(range(self.workers.num_slots))


def assert_exact(run: Run, seqs: list[Sequence]) -> None:
    for seq in seqs:
        want = truth(seq.prompt_ids, seq.params.max_new_tokens)
        assert seq.finish_reason == "length", seq.request_id
        assert seq.generated == want, seq.request_id
        assert run.deltas[f"{seq.request_id}/{seq.index}"] == want   # the stream, in order


SYSTEM = [7000 + i for i in range(22)]          # 5 full blocks and 2 tokens


def user(i: int, n: int = 5) -> list[int]:
    return [100 * (i + 1) + j for j in range(n)]


# --- prefix hits ------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_len", [DRAFT_LEN, None], ids=["k3", "auto"])
def test_shared_system_prompt_hits(draft_len):
    run = Run(num_blocks=200, draft_len=draft_len)
    first = run.add(make_seq("r0", SYSTEM + user(0), 20))
    run.step()                                  # the first one prefills and runs a round
    later = [run.add(make_seq(f"r{i}", SYSTEM + user(i), 20)) for i in range(1, 4)]
    run.drain()
    assert_exact(run, [first] + later)
    assert first.cached_prompt_tokens == 0
    shared_blocks = len(SYSTEM) // BS
    for seq in later:
        assert seq.cached_prompt_tokens == shared_blocks * BS
        assert seq.stats()["cached_prompt_tokens"] == shared_blocks * BS
    fed = {tuple(p["prompt"]): p["fed"] for p in run.workers.prefills}
    assert fed[tuple(first.prompt_ids)] == len(first.prompt_ids) - 1
    for seq in later:                           # the prefill sends fewer tokens
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
    prompt = SYSTEM + user(0, 6)                # 28 tokens: 7 full blocks
    a = run.add(make_seq("a", prompt, 8))
    run.drain()
    b = run.add(make_seq("b", prompt, 8))
    run.drain()
    assert b.cached_prompt_tokens == 24         # block 7 holds the last token
    assert run.workers.prefills[-1]["fed"] == 27 - 24
    c = run.add(make_seq("c", prompt + [5], 8))
    run.drain()
    assert c.cached_prompt_tokens == 28
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
    assert second.cached_prompt_tokens == ((committed - 1) // BS) * BS
    assert second.cached_prompt_tokens > len(SYSTEM + user(0))
    assert_exact(run, [first, second])
    run.check_idle()


def test_prefix_caching_off_never_hits():
    run = Run(num_blocks=200, prefix_caching=False)
    first = run.add(make_seq("r0", SYSTEM + user(0), 12))
    run.step()
    later = [run.add(make_seq(f"r{i}", SYSTEM + user(i), 12)) for i in range(1, 4)]
    run.drain()
    assert_exact(run, [first] + later)
    assert all(s.cached_prompt_tokens == 0 for s in [first] + later)
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
    assert sum(s.preemptions for s in seqs) == small.sched.metrics.preemptions
    assert_exact(small, seqs)
    assert [s.generated for s in seqs] == [s.generated for s in ref]
    assert all(len(s.generated) == 90 for s in seqs)
    # a readmission is a prefix hit of its own committed blocks, not a prompt's hit
    readmitted = [p for p in small.workers.prefills if p["cached"] > 0]
    assert readmitted
    for seq in seqs:
        assert seq.cached_prompt_tokens <= len(seq.prompt_ids)
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
    assert new.preemptions == 1 and old.preemptions == 0
    assert run.sched.queue[0] is new and new.slot is None and old.slot is not None
    run.drain()
    assert_exact(run, [old, new])
    run.check_idle()


# --- cancellation -----------------------------------------------------------------------------
def test_cancel_running_queued_and_preempted_leaks_nothing():
    run = Run(num_blocks=pool_for_one() + 4, num_slots=3)
    seqs = [run.add(s) for s in long_requests(6)]
    # run until a preempted request waits in the queue
    while not any(s.preemptions and queued(run, s) for s in seqs):
        run.step()
    preempted = next(s for s in seqs if s.preemptions and queued(run, s))
    assert preempted.generated              # it ran before it was preempted
    running = next(iter(run.sched.running.values()))
    never = next(s for s in seqs if queued(run, s) and not s.preemptions and not s.generated)
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
    assert again[0].cached_prompt_tokens > 0
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
    assert all(s.cached_prompt_tokens == min(reach, len(SYSTEM) // BS * BS) for s in later)
    follow = run.add(make_seq("f", first.tokens, 5))
    run.drain()
    # the first's generated tokens were indexed only as far as the least report went
    known = next(n for tokens, n in run.workers.released
                 if tokens[:len(first.tokens)] == first.tokens)
    assert follow.cached_prompt_tokens == min(known, len(first.tokens) - 1) // BS * BS
    assert follow.cached_prompt_tokens > len(SYSTEM)
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
    assert follow.cached_prompt_tokens == 0
    assert_exact(run, [seq, follow])
    run.check_idle()


# --- churn --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_cancels_and_small_pool(seed):
    """Requests arrive at random steps, some sharing prefixes, some cancelled at random (queued,
    running or preempted); every one not cancelled ends exact, nothing leaks."""
    rng = random.Random(seed)
    run = Run(num_blocks=pool_for_one() + rng.randrange(0, 30), num_slots=rng.choice([2, 4]),
              draft_len=rng.choice([1, 3, None]), seed=seed, lag=rng.choice([(0,), (0, 2)]),
              max_prefill_tokens=[None, 2, 7, 16][seed])
    prefixes = [SYSTEM[:n] for n in (0, 9, 22)]
    pending = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        pending.append((rng.randrange(0, 120), make_seq(f"c{i}", prompt,
                                                        rng.randrange(1, 100))))
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
    stream gets tokens in every step meanwhile; both end exact, with no block left."""
    run = Run(num_blocks=400, max_prefill_tokens=budget)
    steady = run.add(make_seq("steady", user(0), 100))   # decodes past the long prefill
    run.step()                             # alone: its prompt whole, nothing to wait on it
    length = min(120, 20 * budget)         # 20 steps at most: the stream outlasts them
    long = run.add(make_seq("long", [9000 + i for i in range(length)], 12))
    sizes, gaps = [], 0
    while not long.ready or long.slot is None:
        before = len(steady.generated)
        prefills = len(run.workers.prefills)
        run.step()
        sizes += [len(p["prompt"]) - p["cached"] for p in run.workers.prefills[prefills:]]
        gaps += len(steady.generated) == before and steady.finish_reason is None
    run.drain()
    assert_exact(run, [steady, long])
    assert len(sizes) >= length // budget and max(sizes) <= budget  # chunks within the budget
    assert gaps == 0                                   # the stream never waited a whole step
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
    assert all(s.cached_prompt_tokens == len(SYSTEM) // BS * BS for s in later)
    assert any(p["cached"] > 0 and not p["final"] for p in run.workers.prefills)
    run.check_idle()


def test_with_nothing_decoding_prompts_are_prefilled_whole():
    """The budget holds only while requests decode: prompts arriving at an idle server are
    prefilled whole in one step (nothing waits on them), the next one beside a decoding
    stream in chunks."""
    run = Run(num_blocks=400, max_prefill_tokens=8)
    first = [run.add(make_seq(f"a{i}", [7000 + 50 * i + j for j in range(40)], 30))
             for i in range(2)]
    run.step()
    assert all(s.ready for s in first)
    assert [len(p["prompt"]) - p["cached"] for p in run.workers.prefills] == [40, 40]
    later = run.add(make_seq("b", [9000 + j for j in range(40)], 4))
    done = len(run.workers.prefills)
    run.step()
    assert not later.ready and len(run.workers.prefills[done]["prompt"]) <= 8
    run.drain()
    assert_exact(run, first + [later])
    run.check_idle()
