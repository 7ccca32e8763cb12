"""The orchestrator's scheduler: admits requests while their KV blocks are free, runs
speculation rounds on the workers, appends accepted tokens, checks stop conditions and retires
finished requests (in-flight batching: requests join and leave between rounds).

KV blocks (runtime.serving.block_manager): a request is admitted when a row (one of
max_batch_size) and the blocks of its tokens past its cached prefix are free; before each
round every running request holds the blocks its round may write (`lookahead` positions past
its committed tokens); when they cannot all grow, the newest is preempted (its blocks freed,
its committed blocks left in the prefix index) and readmitted later with its tokens so far:
its stream goes on where it stopped. Tables travel with the commands that change them.
"""
from __future__ import annotations

import time
from collections import deque

from runtime.speculation.adaptive import TARGET_ONLY_STEPS, DraftLenController, takes_bonus
from runtime.config.schema import MAX_AUTO_DRAFT_LEN
from runtime.control import commands, protocol
from runtime.control.pool import WorkerPool
from runtime.serving.block_manager import BlockManager
from runtime.serving.cross_round import CrossRounds, RoundOutcome
from runtime.serving.metrics import ServingMetrics
from runtime.serving.sequence import Event, Sequence

__all__ = ["Event", "Scheduler", "Sequence", "round_lookahead"]


def round_lookahead(max_draft_len: int, overlap: bool) -> int:
    """Positions past its committed tokens that one round of a request may write, with the
    work done ahead for the next: a verify (k + 1), the next round's proposals or window
    (k + 1 more, twice with overlap), or a target-only round and its step ahead."""
    windows = 3 if overlap else 2
    return max(windows * (max_draft_len + 1), TARGET_ONLY_STEPS + 1) + 2


class Scheduler:
    def __init__(self, pool: WorkerPool, num_slots: int, draft_len: int | None,
                 eos_token_ids: tuple[int, ...], step_timeout_s: float,
                 overlap: bool = False, acceptance: str = "tokens",
                 blocks: BlockManager | None = None, table_len: int | None = None,
                 max_prefill_tokens: int | None = None, cross: CrossRounds | None = None):
        """num_slots: requests running at once (runtime.max_batch_size); blocks: the KV
        pool's books (default: room for num_slots requests of table_len positions, no
        prefix caching); table_len: the most positions one request's table addresses;
        max_prefill_tokens: prompt tokens one step may prefill while requests decode (None:
        whole prompts); cross: the rounds of a draft with another tokenizer."""
        if max_prefill_tokens is not None and max_prefill_tokens < 2:
            raise ValueError(f"max_prefill_tokens must be >= 2, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.cross = cross
        self.pool = pool
        self.draft_len = MAX_AUTO_DRAFT_LEN if draft_len is None else draft_len  # max k
        self.controller = DraftLenController(draft_len, MAX_AUTO_DRAFT_LEN, overlap)
        self.overlap = overlap   # workers draft the next window during verification
        self.acceptance = acceptance
        self.eos = set(eos_token_ids)
        self.step_timeout_s = step_timeout_s
        self.lookahead = round_lookahead(self.draft_len, overlap)
        self.table_len = table_len or 1 << 20
        if blocks is None:
            per_request = -(-min(self.table_len, 4096) // 16)
            blocks = BlockManager(num_slots * per_request, 16, prefix_caching=False)
        self.blocks = blocks
        self.free_slots = list(range(num_slots))
        self.queue: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.metrics = ServingMetrics()
        self.next_k: int | None = None      # the next round's k, sent ahead with this one
        self.next_slots: list[int] = []     # ... for these slots
        self._admissions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    def add(self, seq: Sequence) -> None:
        self.queue.append(seq)

    def cancel(self, request_id: str) -> None:
        queued = len(self.queue)
        self.queue = deque(s for s in self.queue if s.request_id != request_id)
        for _ in range(queued - len(self.queue)):
            self.metrics.finished("cancelled", None)
        for seq in self.running.values():
            if seq.request_id == request_id:
                seq.cancelled = True

    def step(self) -> list[Event]:
        """Admit what fits, run one speculation round, return what it produced."""
        events = self._retire_cancelled()
        self._make_room()
        self._admit()
        events += self._prefill_step()
        self._make_room()        # (a no-op: admission left the room for the first round)
        slots = sorted(slot for slot, seq in self.running.items() if seq.ready)
        if not slots:
            self.metrics.idle()
            return events
        k, next_k = self._draft_lens(slots)
        outcome = self._round(slots, k, next_k)
        finished = []
        self.controller.observe(k, outcome.accepted, outcome.cost, outcome.steps)
        for slot, tokens, accepted, kept, held in zip(slots, outcome.tokens, outcome.accepted,
                                                      outcome.overlapped, outcome.cached):
            seq = self.running[slot]
            seq.overlapped_rounds += kept
            events.append(self._append(seq, tokens, accepted, outcome.k, kept))
            self._index(seq, held)
            if seq.finish_reason is not None:
                finished.append(seq)
        events.extend(self._retire(finished))
        return events

    def _round(self, slots: list[int], k: int, next_k: int) -> RoundOutcome:
        """One round of these slots, k drafts each (a draft with another tokenizer: two
        commands, runtime.serving.cross_round)."""
        if self.cross is not None:
            return self.cross.round(self, slots, k)
        steps = 1
        if k == 0:   # target-only: several decode steps on one command, none past a limit
            steps = min(TARGET_ONLY_STEPS, *(self.running[s].params.max_new_tokens -
                                             len(self.running[s].generated) for s in slots))
        command = commands.RoundCommand(slots, k, next_k, steps, self._grow(slots))
        start = self.metrics.round_begins()
        results = self.pool.command(command.to_msg(), self.step_timeout_s)
        cost = self.metrics.round_ends(start, results, k)
        replies = _replies(results)
        verdict = _verdict(replies)
        return RoundOutcome(verdict.tokens, verdict.accepted,
                            verdict.overlapped or [False] * len(slots),
                            _cached(replies, len(slots)), cost, steps, k)

    def _draft_lens(self, slots: list[int]) -> tuple[int, int]:
        """(k of this round, k of the next one). The next round's k is chosen a round early,
        without this round's outcome, so the workers start on exactly that work (the draft's
        k proposals, or a target-only step) while this round's result and the next command
        travel; a round that drafted ahead more than it uses would pay for the waste, and
        the controller would read that as the cost of the smaller k."""
        batch = len(slots)
        # overlapped, the announced k stands whatever joined or left: slots whose window was
        # kept hold no pending token and need a drafting round
        announced = self.next_k is not None and (self.overlap or self.next_slots == slots)
        bonus = takes_bonus(all(self.running[s].params.greedy for s in slots), self.acceptance)
        k = self.next_k if announced else self.controller.choose(batch, bonus)
        self.next_k, self.next_slots = self.controller.choose(batch, bonus), slots
        return k, self.next_k

    def _admit(self) -> None:
        """Admit queued requests in order while a row and their blocks are free (past the
        blocks the running requests grow into this round); _prefill_step prefills them."""
        growth = self._growth()
        while self.queue and self.free_slots:
            seq = self.queue[0]
            tokens = seq.tokens
            matched = self.blocks.match(tokens[:-1])   # the last token is fed, not cached
            positions = self._reach(seq.length + 1)    # its prefill brings one token
            if self.blocks.cost(matched, positions) + growth > self.blocks.available:
                break
            self.queue.popleft()
            seq.table = self.blocks.start(matched, positions)
            seq.prefill_at, seq.ready = len(matched) * self.blocks.block_size, False
            if not seq.preemptions:   # a readmission's prefix is its own, not a prompt's
                seq.cached_prompt_tokens = seq.prefill_at
                if self.blocks.prefix_caching:
                    self.metrics.prefix_lookup(len(tokens), seq.cached_prompt_tokens)
            seq.slot = self.free_slots.pop(0)
            self._admissions += 1
            seq.admitted = self._admissions
            self.running[seq.slot] = seq

    def _chunks(self) -> list[tuple[Sequence, list[int], bool]]:
        """This step's prefill work, in admission order: (sequence, its tokens from
        prefill_at on, whether they end its prompt), at most max_prefill_tokens tokens in
        all while some request is decoding (with none, nothing waits on the prefill: whole
        prompts); a prompt cut short keeps its chunk's last token pending for the next."""
        decoding = any(s.ready for s in self.running.values())
        budget = self.max_prefill_tokens if decoding else None
        chunks = []
        for seq in sorted((s for s in self.running.values() if not s.ready),
                          key=lambda s: s.admitted):
            tokens = seq.tokens[seq.prefill_at:]
            if budget is not None and len(tokens) > budget:
                if budget >= 2:     # a chunk feeds at least one token and keeps one pending
                    chunks.append((seq, tokens[:budget], False))
                break
            chunks.append((seq, tokens, True))
            if budget is not None:
                budget -= len(tokens)
        return chunks

    def _prefill_step(self) -> list[Event]:
        """One prefill command for this step's chunks (_chunks); a prompt's last chunk
        brings its first token (the target's, from the prompt's last position)."""
        chunks = self._chunks()
        if not chunks:
            return []
        start = time.perf_counter()
        command = commands.PrefillCommand(
            [seq.slot for seq, _, _ in chunks], [tokens for _, tokens, _ in chunks],
            [seq.worker_params() for seq, _, _ in chunks],
            [seq.prefill_at for seq, _, _ in chunks],
            [list(seq.table.blocks) for seq, _, _ in chunks], [f for _, _, f in chunks])
        results = self.pool.command(command.to_msg(), self.step_timeout_s)
        self.metrics.prefill_done(time.perf_counter() - start,   # prompts, once each
                                  sum(len(seq.prompt_ids) for seq, _, final in chunks
                                      if final and not seq.preemptions))
        replies = _replies(results)
        events, verdict = [], _verdict(replies)
        for (seq, tokens, final), first, held in zip(chunks, verdict.tokens,
                                                     _cached(replies, len(chunks))):
            seq.prefill_at += len(tokens) - 1
            if final:
                seq.ready = True
                events.append(self._deliver(seq, first))
                self.metrics.prefill_tokens(len(events[-1].token_ids))
            self._index(seq, held)
        return events + self._retire([seq for seq, _, _ in chunks
                                      if seq.finish_reason is not None])

    def _reach(self, committed: int) -> int:
        """Positions a request of `committed` tokens must address for its next round."""
        return min(committed + self.lookahead, self.table_len)

    def _make_room(self) -> None:
        """Preempt the newest running requests until every other one can grow for its next
        round."""
        while self.running and self._growth() > self.blocks.available:
            self._preempt(max(self.running.values(), key=lambda s: s.admitted))

    def _growth(self) -> int:
        """Blocks the running requests take when they grow for their next round."""
        return sum(max(0, self.blocks.blocks_for(self._reach(s.length)) -
                       len(s.table.blocks)) for s in self.running.values())

    def _grow(self, slots: list[int]) -> list[list[int]]:
        """Each slot's new blocks for this round (_make_room left enough)."""
        return [self.blocks.grow(self.running[s].table, self._reach(self.running[s].length))
                for s in slots]

    def _index(self, seq: Sequence, cached: int) -> None:
        """Index the sequence's full blocks below `cached` (every rank holds their KV); its
        token list is built only when a new block is full (most rounds complete none)."""
        if cached // self.blocks.block_size > len(seq.table.keys):
            self.blocks.register(seq.table, seq.tokens, cached)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's row and blocks; it waits first in line to be readmitted
        with its tokens so far (most of them a prefix hit)."""
        self.pool.command(commands.ReleaseCommand([seq.slot]).to_msg(), self.step_timeout_s)
        self._free(seq)
        seq.preemptions += 1
        self.metrics.preempted()
        self.queue.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        del self.running[seq.slot]
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.blocks.free(seq.table)
        seq.slot = None

    def _append(self, seq: Sequence, tokens: list[int], accepted: int, k: int,
                overlapped: bool = False) -> Event:
        seq.rounds += 1
        seq.target_only_rounds += k == 0
        seq.proposed += k
        seq.accepted += accepted
        seq.tested += min(accepted + 1, k)
        if len(seq.accepted_at) < self.draft_len:
            seq.accepted_at.extend([0] * (self.draft_len - len(seq.accepted_at)))
        for i in range(accepted):
            seq.accepted_at[i] += 1
        seq.emitted_per_round.append(len(tokens))
        event = self._deliver(seq, tokens)
        self.metrics.committed(k, accepted, len(event.token_ids), overlapped)
        return event

    def _deliver(self, seq: Sequence, tokens: list[int]) -> Event:
        """Committed tokens to the sequence's output, up to its limits and stops."""
        room = seq.params.max_new_tokens - len(seq.generated)
        new = tokens[:room]
        for i, tok in enumerate(new):
            if tok in self.eos:
                new = new[: i + 1]
                seq.finish_reason = "stop"
                break
        new, stopped = seq.stream.add(new)
        if stopped:
            seq.finish_reason = "stop"
        if new:
            now = time.perf_counter()
            if seq.t_first is None:
                seq.t_first = now
                self.metrics.first_token(now - seq.t_start)
            else:
                self.metrics.delivered(now - seq.t_last, len(new))
            seq.t_last = now
        seq.generated.extend(new)
        if seq.finish_reason is None and len(seq.generated) >= seq.params.max_new_tokens:
            seq.finish_reason = "length"
        return Event("delta", seq, new, seq.stream.delta(final=seq.finish_reason is not None))

    def _retire_cancelled(self) -> list[Event]:
        gone = [s for s in self.running.values() if s.cancelled]
        for seq in gone:
            seq.finish_reason = "cancelled"
        return self._retire(gone)

    def _retire(self, seqs: list[Sequence]) -> list[Event]:
        if not seqs:
            return []
        slots = [s.slot for s in seqs]
        self.pool.command(commands.ReleaseCommand(slots).to_msg(), self.step_timeout_s)
        events = []
        for seq in seqs:
            self._free(seq)
            seq.t_end = time.perf_counter()
            self.metrics.finished(seq.finish_reason, seq.t_end - seq.t_start)
            events.append(Event("final", seq, [], ""))
        return events


def _replies(results: dict[int, dict]) -> list[commands.RoundReply]:
    """A round's or a prefill's replies (one per worker rank), checked."""
    return [commands.RoundReply.from_map(r) for r in results.values()]


def _cached(replies: list[commands.RoundReply], batch: int) -> list[int]:
    """Per slot of a round, the positions every rank holds the KV of committed tokens for
    (the least any rank reports)."""
    reports = [r.cached for r in replies if r.cached]
    if not reports:
        return [0] * batch
    return [min(column) for column in zip(*reports)]


def _verdict(replies: list[commands.RoundReply]) -> commands.RoundReply:
    """The target leader's reply among a round's replies (one per worker rank)."""
    leaders = [r for r in replies if r.reports]
    if len(leaders) != 1:
        raise protocol.ProtocolError(f"a round got {len(leaders)} target leader replies")
    return leaders[0]
