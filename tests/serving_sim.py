"""A simulation of the workers for scheduler tests: FakeWorkers stands in for the WorkerPool
behind a real Executor (runtime.serving.executor) and keeps, from the prefill/round/release
commands alone, each slot's committed tokens, its cache length and its block table, and what
every block's KV holds (one token per position, as the model's K/V would). It sends every
command and reply through msgpack (runtime.control.protocol), and checks that no slot writes
outside its table or into a block another slot holds or the prefix index serves, that a
round's tables address what the round may write, and that a prefill's `cached` positions are
exactly blocks whose contents are the new prompt's tokens (so a prefix hit is correct). The
target is deterministic (next token = f(tokens before it)), so a request's tokens do not depend
on how it was scheduled: preempted, readmitted from a prefix hit, or run alone. Rejected drafts
are written into the KV as garbage, as real ones are, and positions count as known-cached only
once every rank's RoundReply.cached covers them. `Run` drives a Scheduler through it a step at
a time, as the orchestrator does (runtime.serving.executor.run_step)."""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import replace

from runtime.control import commands, protocol
from runtime.params import SamplingParams
from runtime.serving.block_manager import ROOT, BlockManager, chain_key
from runtime.serving.executor import Executor, run_step
from runtime.serving.scheduler import Scheduler, Sequence, round_lookahead
from runtime.serving.sequence import SeqStatus
from runtime.serving.textstream import TextStream

BS = 4  # positions per KV block
VOCAB = 50_000
MAX_SEQ_LEN = 160
DRAFT_LEN = 3


def next_token(tokens: list[int]) -> int:
    """The fake target's greedy token after `tokens` (depends on all of them)."""
    digest = hashlib.blake2b(
        array("q", tokens[-12:]).tobytes() + len(tokens).to_bytes(4, "little"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") % VOCAB


def truth(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


GARBAGE = -1  # what a rejected draft (or a draft drafted ahead) leaves in the KV


class Slot:
    def __init__(self, tokens: list[int], table: list[int], cache_len: int):
        self.tokens = list(tokens)  # committed (may run past max_new_tokens, as real ones)
        self.table = list(table)
        self.cache_len = cache_len  # positions holding committed tokens' KV


class FakeWorkers:
    """Stands in for the WorkerPool: `ranks` workers, the first the target leader; rank r > 0
    reports `cached` lagging by lag[r] positions (a rank whose cache is behind)."""

    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        table_len: int,
        draft_len_max: int,
        seed: int = 0,
        lag: tuple[int, ...] = (0,),
        accept: float = 0.6,
        silent: bool = False,
    ):
        self.num_blocks, self.num_slots, self.table_len = num_blocks, num_slots, table_len
        self.lookahead = round_lookahead(draft_len_max, False)
        self.rng = random.Random(seed)
        self.lag, self.accept = lag, accept
        self.silent = silent  # replies report no cached positions at all (an empty list)
        self.slots: dict[int, Slot] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.confirmed: dict[int, list[bool]] = {}  # per block position: every rank caches it
        self.named: dict[bytes, list[int]] = {}  # chain key -> its block's tokens
        self.sched: Scheduler | None = None
        self.prefills: list[dict] = []  # per prefilled sequence: prompt, cached
        self.rounds = self.step = 0
        self.max_reported: dict[int, int] = {}  # slot -> the most positions known cached
        self.released: list[tuple[list[int], int]] = []  # (tokens, max_reported) at release

    # --- the pool's interface -----------------------------------------------------------------
    def command(self, cmd: commands.Command, timeout_s: float) -> dict[int, commands.Reply]:
        self.step += 1  # as WorkerPool.command stamps it
        cmd = protocol.decode(protocol.encode(replace(cmd, step=self.step)))  # through msgpack
        if isinstance(cmd, commands.PrefillCommand):
            replies = self._prefill(cmd)
        elif isinstance(cmd, commands.ReleaseCommand):
            for slot in cmd.slots:
                if slot not in self.slots:  # admitted, ended before its first chunk
                    assert 0 <= slot < self.num_slots, f"release of slot {slot}"
                    continue
                self.released.append((self.slots.pop(slot).tokens, self.max_reported.pop(slot)))
            replies = self._acks()
        else:
            assert isinstance(cmd, commands.RoundCommand), cmd
            replies = self._round(cmd)
        return {  # the replies through msgpack too, each in its done message
            rank: protocol.decode(protocol.encode(protocol.Done(rank, self.step, reply))).result
            for rank, reply in replies.items()
        }

    def _acks(self) -> dict[int, commands.Reply]:
        return {rank: commands.StepAck() for rank in range(len(self.lag))}

    # --- prefill --------------------------------------------------------------------------------
    def _prefill(self, cmd: commands.PrefillCommand) -> dict[int, commands.Reply]:
        """Each slot's tokens from `cached` on (checked against the scheduler's sequence):
        a chunk caches all but its last token; a prompt's end is cached whole by both models
        (the target picks the first output token): every rank reports that."""
        assert len(cmd.tables) == len(cmd.slots)
        report = []
        for slot, part, cached, table, final in zip(
            cmd.slots, cmd.prompts, cmd.cached, cmd.tables, cmd.final
        ):
            tokens = self.sched.running[slot].tokens
            assert part == tokens[cached : cached + len(part)] and len(part) >= 1
            assert final == (cached + len(part) == len(tokens)) and (final or len(part) >= 2)
            prompt = tokens[: cached + len(part)]
            self._start(slot, prompt, cached, table)
            self._write(slot, range(cached, len(prompt) - (0 if final else 1)), prompt)
            if final:
                self.slots[slot].tokens += truth(prompt, 1)
            self.slots[slot].cache_len = len(prompt) - (0 if final else 1)
            self.prefills.append(
                {
                    "prompt": list(prompt),
                    "cached": cached,
                    "fed": len(prompt) - 1 - cached,
                    "final": final,
                }
            )
            report.append(len(prompt) - (0 if final else 1))  # a prompt's end: all of it
        replies = {}
        for rank, lag in enumerate(self.lag):
            cached = [] if self.silent else [max(0, c - lag) for c in report]
            if rank == 0:
                firsts = [
                    self.slots[s].tokens[-1:] if f else [] for s, f in zip(cmd.slots, cmd.final)
                ]
                reply = commands.RoundReply(
                    commands.TARGET_LEADER,
                    0.001,
                    cached=cached,
                    tokens=firsts,
                    accepted=[0] * len(cmd.slots),
                )
            else:
                reply = commands.RoundReply(commands.WORKER, 0.001, cached=cached)
            replies[rank] = reply
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
        if slot in self.slots:  # a later chunk: where the last one stopped
            assert self.slots[slot].cache_len == cached and self.slots[slot].table == table
            self.slots[slot].tokens = list(prompt)
            return
        assert cached % BS == 0 and 0 <= cached < len(prompt)
        # the prefix hit: every cached position is known on every rank to hold the prompt's
        # token there
        for p in range(cached):
            block, off = table[p // BS], p % BS
            assert self.confirmed.get(block, [False] * BS)[off], (
                f"slot {slot}: position {p} (block {block}) sent as cached, never cached"
            )
            assert self.kv[block][off] == prompt[p], (
                f"slot {slot}: a prefix hit on block {block} holding other tokens"
            )
        # blocks past the hit are this slot's alone; shared ones are whole cached blocks
        holders = self._holders()
        for i, block in enumerate(table):
            if i >= cached // BS:
                assert block not in holders, (
                    f"slot {slot}: block {block} is slot {holders.get(block)}'s too"
                )
        full = len(self.sched.running[slot].tokens)
        assert len(table) * BS >= min(full + 1 + self.lookahead, self.table_len), (
            f"slot {slot}: a table of {len(table) * BS} positions for {full} tokens"
        )
        self.slots[slot] = Slot(prompt, table, cached)

    # --- rounds -----------------------------------------------------------------------------
    def _round(self, cmd: commands.RoundCommand) -> dict[int, commands.Reply]:
        self.rounds += 1
        assert cmd.slots == sorted(set(cmd.slots)) and set(cmd.slots) <= set(self.slots)
        assert len(cmd.tables) == len(cmd.slots)
        holders = self._holders()
        for slot, new in zip(cmd.slots, cmd.tables):
            for block in new:  # new blocks are nobody's (free, or evicted from the cache)
                assert 0 <= block < self.num_blocks
                assert block not in holders, (
                    f"slot {slot} grows by block {block}, held by slot {holders[block]}"
                )
                holders[block] = slot
            self.slots[slot].table.extend(new)
        tokens, accepted, cached = [], [], []
        for slot in cmd.slots:
            s = self.slots[slot]
            committed = len(s.tokens)
            assert s.cache_len == committed - 1
            need = min(committed + self.lookahead, self.table_len)
            assert len(s.table) * BS >= need, (
                f"slot {slot}: {len(s.table) * BS} positions for a round at {committed}"
            )
            if cmd.k == 0:  # target-only: `steps` decode steps, all committed
                new = truth(s.tokens, cmd.steps)
                s.tokens += new
                self._write(slot, range(committed - 1, committed - 1 + cmd.steps), s.tokens)
                tokens.append(new)
                accepted.append(0)
            else:  # verify pending + k drafts; `a` drafts right, the rest not
                a = 0
                while a < cmd.k and self.rng.random() < self.accept:
                    a += 1
                new = truth(s.tokens, a + 1)
                s.tokens += new
                self._write(slot, range(committed - 1, committed + a), s.tokens)
                self._write(slot, range(committed + a, committed + cmd.k), None)  # rejected
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
                reply = commands.RoundReply(
                    commands.TARGET_LEADER,
                    0.001 * (cmd.k + 1),
                    tokens=tokens,
                    accepted=accepted,
                    cached=report,
                )
            else:
                reply = commands.RoundReply(commands.WORKER, 0.001, cached=report)
            replies[rank] = reply
        known = [0 if self.silent else min(max(0, c - lag) for lag in self.lag) for c in cached]
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
            assert books is None or books.key_of[block] is None, (
                f"slot {slot} writes into block {block}, which the prefix index serves"
            )
            self.kv.setdefault(block, [None] * BS)[p % BS] = (
                GARBAGE if tokens is None else tokens[p]
            )
            self.confirmed.setdefault(block, [False] * BS)[p % BS] = False

    def _confirm(self, slot: int, upto: int) -> None:
        """Every rank caches the slot's committed KV below `upto`."""
        s = self.slots[slot]
        parent = ROOT
        for p in range(upto):
            block = s.table[p // BS]
            assert self.kv[block][p % BS] == s.tokens[p], (
                f"slot {slot}: position {p} reported cached holds {self.kv[block][p % BS]}"
            )
            self.confirmed[block][p % BS] = True
        for start in range(0, upto - BS + 1, BS):
            parent = chain_key(parent, s.tokens[start : start + BS])
            self.named[parent] = s.tokens[start : start + BS]

    # --- checks after a step -----------------------------------------------------------------
    def check_books(self) -> None:
        sched = self.sched
        blocks = sched.blocks
        assert set(self.slots) <= set(sched.running) | set(sched.releasing)
        held = set()
        for slot, seq in sched.running.items():
            if slot not in self.slots:  # admitted, its first chunk not sent yet
                assert seq.status is SeqStatus.PREFILLING
                held.update(seq.table.blocks)
                continue
            assert seq.table.blocks == self.slots[slot].table
            mine = self.slots[slot].tokens  # a prompt in chunks: its part so far
            assert mine[: len(seq.tokens)] == seq.tokens[: len(mine)]
            held.update(seq.table.blocks)
            # a table's indexed leading blocks: never past what every rank reported cached
            reported = self.max_reported[slot]
            assert len(seq.table.keys) * BS <= reported, (
                f"slot {slot}: {len(seq.table.keys)} blocks keyed, {reported} positions cached"
            )
        assert blocks.used == len(held)
        assert sum(blocks.refs) == sum(len(s.table.blocks) for s in sched.running.values())
        for key, block in blocks.index.items():
            assert blocks.key_of[block] == key
            assert all(self.confirmed[block]), f"indexed block {block} is not all cached"
            assert key in self.named and self.kv[block] == self.named[key], (
                f"indexed block {block} holds {self.kv[block]}, not its key's tokens"
            )


# --- driving --------------------------------------------------------------------------------
def make_seq(rid: str, prompt: list[int], max_new: int, index: int = 0) -> Sequence:
    return Sequence(
        rid,
        index,
        list(prompt),
        SamplingParams.from_kwargs(max_new_tokens=max_new),
        TextStream(None),
    )


class Run:
    def __init__(
        self,
        num_blocks: int,
        num_slots: int = 4,
        draft_len: int | None = DRAFT_LEN,
        prefix_caching: bool = True,
        seed: int = 0,
        lag: tuple[int, ...] = (0,),
        accept: float = 0.6,
        silent: bool = False,
        max_prefill_tokens: int | None = None,
    ):
        table_len = MAX_SEQ_LEN + (draft_len or 8) + 2  # TandemConfig.kv_seq_len
        self.blocks = BlockManager(num_blocks, BS, prefix_caching)
        self.workers = FakeWorkers(
            num_blocks,
            num_slots,
            table_len,
            draft_len if draft_len is not None else 8,
            seed,
            lag,
            accept,
            silent,
        )
        self.sched = Scheduler(
            num_slots,
            draft_len,
            eos_token_ids=(),
            blocks=self.blocks,
            table_len=table_len,
            max_prefill_tokens=max_prefill_tokens,
        )
        self.executor = Executor(self.workers, 5.0, self.sched.metrics)
        self.workers.sched = self.sched
        self.finals: list[Sequence] = []
        self.deltas: dict[str, list[int]] = {}
        self.steps = 0

    def add(self, seq: Sequence) -> Sequence:
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        for event in run_step(self.sched, self.executor):
            key = f"{event.seq.request_id}/{event.seq.index}"
            if event.kind.value == "delta":
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
        assert run.deltas[f"{seq.request_id}/{seq.index}"] == want  # the stream, in order
