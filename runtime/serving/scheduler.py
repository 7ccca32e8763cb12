"""The orchestrator's scheduler: it decides, the executor (runtime.serving.executor) carries
out. `schedule()` admits requests while their KV blocks are free and plans one step (a
StepPlan: slots to release, prompt chunks to prefill, one speculation round); `prefilled` and
`rounded` (plan, replies) append what the workers committed, check stop conditions and retire
what ended (in-flight batching: requests join and leave between rounds). It sends nothing
itself (runtime.serving.executor.run_step drives a step).

KV blocks (runtime.serving.block_manager): a request is admitted when a row (one of
max_batch_size) and the blocks of its tokens past its cached prefix are free; before each
round every running request holds the blocks its round may write (`lookahead` positions past
its committed tokens); when they cannot all grow, the newest is preempted (its blocks freed,
its committed blocks left in the prefix index) and readmitted later with its tokens so far:
its stream goes on where it stopped. Tables travel with the commands that change them; a slot
freed in the books is released on the workers first thing in the next plan.
"""

from __future__ import annotations

import time
from collections import deque

from runtime.config.schema import MAX_AUTO_DRAFT_LEN
from runtime.serving.block_manager import BlockManager
from runtime.serving.metrics import ServingMetrics
from runtime.serving.plan import PrefillChunk, RoundPlan, StepPlan, StepReplies
from runtime.serving.sequence import Event, EventKind, SeqStatus, Sequence
from runtime.speculation.adaptive import TARGET_ONLY_STEPS, DraftLenController, takes_bonus

__all__ = ["Event", "Scheduler", "Sequence", "round_lookahead"]


def round_lookahead(max_draft_len: int, overlap: bool) -> int:
    """Positions past its committed tokens that one round of a request may write, with the
    work done ahead for the next: a verify (k + 1), the next round's proposals or window
    (k + 1 more, twice with overlap), or a target-only round and its step ahead."""
    windows = 3 if overlap else 2
    return max(windows * (max_draft_len + 1), TARGET_ONLY_STEPS + 1) + 2


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        draft_len: int | None,
        eos_token_ids: tuple[int, ...],
        overlap: bool = False,
        acceptance: str = "tokens",
        blocks: BlockManager | None = None,
        table_len: int | None = None,
        max_prefill_tokens: int | None = None,
        metrics: ServingMetrics | None = None,
    ):
        """num_slots: requests running at once (runtime.max_batch_size); blocks: the KV
        pool's books (default: room for num_slots requests of table_len positions, no
        prefix caching); table_len: the most positions one request's table addresses;
        max_prefill_tokens: prompt tokens one step may prefill (None: whole prompts)."""
        if max_prefill_tokens is not None and max_prefill_tokens < 2:
            raise ValueError(f"max_prefill_tokens must be >= 2, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.draft_len = MAX_AUTO_DRAFT_LEN if draft_len is None else draft_len  # max k
        self.controller = DraftLenController(draft_len, MAX_AUTO_DRAFT_LEN, overlap)
        self.overlap = overlap  # workers draft the next window during verification
        self.acceptance = acceptance
        self.eos = set(eos_token_ids)
        self.lookahead = round_lookahead(self.draft_len, overlap)
        self.table_len = table_len or 1 << 20
        if blocks is None:
            per_request = -(-min(self.table_len, 4096) // 16)
            blocks = BlockManager(num_slots * per_request, 16, prefix_caching=False)
        self.blocks = blocks
        self.free_slots = list(range(num_slots))
        self.queue: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> its sequence (prefilling or running)
        self.metrics = metrics or ServingMetrics()
        self.next_k: int | None = None  # the next round's k, sent ahead with this one
        self.next_slots: list[int] = []  # ... for these slots
        self._admissions = 0
        self._releases: list[int] = []  # slots freed in the books, not yet on the workers
        self._ended: list[Event] = []  # final events of what schedule() retired

    @property
    def releasing(self) -> list[int]:
        """Slots freed in the books that the next plan releases on the workers."""
        return list(self._releases)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running or self._releases)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        eos = frozenset() if seq.params.ignore_eos else frozenset(self.eos)
        seq.stop_ids = eos | frozenset(seq.params.stop_token_ids)
        self.queue.append(seq)

    def cancel(self, request_id: str) -> None:
        queued = len(self.queue)
        self.queue = deque(s for s in self.queue if s.request_id != request_id)
        for _ in range(queued - len(self.queue)):
            self.metrics.finished("cancelled", None)
        for seq in self.running.values():
            if seq.request_id == request_id:
                seq.status = SeqStatus.CANCELLED

    # --- deciding ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Retire the cancelled, make room, admit what fits, and plan this step."""
        cancelled = [s for s in self.running.values() if s.status is SeqStatus.CANCELLED]
        for seq in cancelled:
            seq.finish("cancelled")
        self._ended = self._retire(cancelled)
        self._make_room()
        self._admit()
        chunks = self._chunks()
        plan = StepPlan(self._releases, chunks, self._plan_round(chunks))
        self._releases = []
        return plan

    def _plan_round(self, chunks: list[PrefillChunk]) -> RoundPlan | None:
        """The round of every running sequence and of those whose prompt ends in this step's
        prefill (but those that end at their first token: one new token left)."""
        joining = {
            c.seq.slot
            for c in chunks
            if c.final and c.seq.params.max_new_tokens - len(c.seq.generated) > 1
        }
        seqs = [
            seq
            for slot, seq in sorted(self.running.items())
            if seq.status is SeqStatus.RUNNING or slot in joining
        ]
        if not seqs:
            return None
        slots: list[int] = [seq.slot for seq in seqs]  # type: ignore[misc]  # running: a slot each
        k, next_k = self._draft_lens(slots)
        # what each row will have committed when the round starts (a joining one: its first)
        committed = [seq.length + (seq.slot in joining) for seq in seqs]
        steps = 1
        if k == 0:  # target-only: several decode steps on one command, none past a limit
            left = [
                s.params.max_new_tokens - (n - len(s.prompt_ids)) for s, n in zip(seqs, committed)
            ]
            steps = min(TARGET_ONLY_STEPS, *left)
        growth = [self.blocks.grow(s.table, self._reach(n)) for s, n in zip(seqs, committed)]
        return RoundPlan(seqs, slots, k, next_k, steps, growth)

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
        k = (
            self.next_k
            if announced and self.next_k is not None
            else self.controller.choose(batch, bonus)
        )
        self.next_k, self.next_slots = self.controller.choose(batch, bonus), slots
        return k, self.next_k

    def _admit(self) -> None:
        """Admit queued requests in order while a row and their blocks are free (past the
        blocks the running requests grow into this round); their prompts are prefilled
        from their cached prefix on."""
        growth = self._growth()
        while self.queue and self.free_slots:
            seq = self.queue[0]
            tokens = seq.tokens
            # the last token is fed, not cached; prompt logprobs need every position's logits
            scored = seq.prompt_logprobs is not None and None in seq.prompt_logprobs[1:]
            matched = [] if scored else self.blocks.match(tokens[:-1])
            positions = self._reach(seq.length + 1)  # its prefill brings one token
            if self.blocks.cost(matched, positions) + growth > self.blocks.available:
                break
            self.queue.popleft()
            seq.table = self.blocks.start(matched, positions)
            seq.prefill_at, seq.status = len(matched) * self.blocks.block_size, SeqStatus.PREFILLING
            if not seq.stats.preemptions:  # a readmission's prefix is its own, not a prompt's
                seq.stats.cached_prompt_tokens = seq.prefill_at
                if self.blocks.prefix_caching:
                    self.metrics.prefix_lookup(len(tokens), seq.prefill_at)
            seq.slot = self.free_slots.pop(0)
            self._admissions += 1
            seq.admitted = self._admissions
            self.running[seq.slot] = seq

    def _chunks(self) -> list[PrefillChunk]:
        """This step's prefill work, in admission order: at most max_prefill_tokens prompt
        tokens in all (None: whole prompts), so the requests decoding get their round after
        each chunk and a new request, a cancellation or a shutdown waits for one chunk at
        most. While none decodes, nobody waits on the prefill: every prompt no longer than
        the budget goes whole (at most max_batch_size of them), and only longer ones are cut,
        so a batch of short prompts starts in one step, in step. A prompt cut short keeps its
        chunk's last token pending for the next."""
        prefilling = sorted(
            (s for s in self.running.values() if s.status is SeqStatus.PREFILLING),
            key=lambda s: s.admitted,
        )
        budget = self.max_prefill_tokens
        if budget is None:
            return [
                PrefillChunk(s, s.tokens[s.prefill_at :], True, s.prefill_at) for s in prefilling
            ]
        idle = not any(s.status is SeqStatus.RUNNING for s in self.running.values())
        left, chunks = budget, []
        for seq in prefilling:
            tokens = seq.tokens[seq.prefill_at :]
            if len(tokens) <= left or (idle and len(tokens) <= budget):
                chunks.append(PrefillChunk(seq, tokens, True, seq.prefill_at))
                left -= len(tokens)
                continue
            if left >= 2:  # a chunk feeds at least one token and keeps one pending
                chunks.append(PrefillChunk(seq, tokens[:left], False, seq.prefill_at))
            break
        return chunks

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
        return sum(
            max(0, self.blocks.blocks_for(self._reach(s.length)) - len(s.table.blocks))
            for s in self.running.values()
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's row and blocks; it waits first in line to be readmitted
        with its tokens so far (most of them a prefix hit)."""
        self._free(seq)
        seq.stats.preemptions += 1
        self.metrics.preempted()
        seq.status = SeqStatus.WAITING
        self.queue.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        assert seq.slot is not None
        del self.running[seq.slot]
        self._releases.append(seq.slot)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.blocks.free(seq.table)
        seq.slot = None

    # --- taking the workers' answers ------------------------------------------------------
    def update(self, plan: StepPlan, replies: StepReplies) -> list[Event]:
        """The whole step's events at once (prefilled, then rounded)."""
        return self.prefilled(plan, replies) + self.rounded(plan, replies)

    def prefilled(self, plan: StepPlan, replies: StepReplies) -> list[Event]:
        """What the step's prefill brought, before its round runs: the first tokens of
        prompts that ended, and the finals of what ended there or in schedule()."""
        events, self._ended = self._ended, []
        if plan.prefill:
            events += self._prefilled(plan.prefill, replies)
        return events

    def rounded(self, plan: StepPlan, replies: StepReplies) -> list[Event]:
        """What the step's round brought (nothing without one); finals of what ended."""
        if plan.round is None:
            self.metrics.idle()
            return []
        return self._rounded(plan.round, replies)

    def _prefilled(self, chunks: list[PrefillChunk], replies: StepReplies) -> list[Event]:
        """Each chunk's positions are cached; a prompt's last chunk brings its first token
        (the target's, from the prompt's last position)."""
        assert replies.prefill is not None
        self.metrics.prefill_done(  # prompts, once each
            replies.prefill_s,
            sum(len(c.seq.prompt_ids) for c in chunks if c.final and not c.seq.stats.preemptions),
        )
        events = []
        records = replies.prefill.logprobs or [[]] * len(chunks)
        scored = replies.prefill.prompt_logprobs or [[]] * len(chunks)
        failures = replies.prefill.grammar_failures or [""] * len(chunks)
        for chunk, first, held, rec, prompt_rec, failure in zip(
            chunks, replies.prefill.tokens, replies.prefill_cached, records, scored, failures
        ):
            seq = chunk.seq
            seq.take_prompt_logprobs(chunk.cached + 1, prompt_rec)
            seq.prefill_at = chunk.cached + len(chunk.tokens) - 1
            if chunk.final:
                seq.status = SeqStatus.RUNNING
                events.append(self._deliver(seq, first, rec, failure))
                self.metrics.prefill_tokens(len(events[-1].token_ids))
            self._index(seq, held)
        return events + self._retire([c.seq for c in chunks if c.seq.done])

    def _rounded(self, plan: RoundPlan, replies: StepReplies) -> list[Event]:
        verdict = replies.round
        assert verdict is not None
        overlapped = verdict.overlapped or [False] * len(plan.seqs)
        self.controller.observe(plan.k, verdict.accepted, replies.round_cost_s, replies.round_steps)
        events: list[Event] = []
        finished: list[Sequence] = []
        records = verdict.logprobs or [[]] * len(plan.seqs)
        failures = verdict.grammar_failures or [""] * len(plan.seqs)
        rows = zip(
            plan.seqs, verdict.tokens, verdict.accepted, overlapped, replies.round_cached, records
        )
        for (seq, tokens, accepted, kept, held, rec), failure in zip(rows, failures):
            if seq.done:  # ended at its first token, in this step's prefill: nothing more
                continue
            seq.stats.overlapped_rounds += kept
            seq.stats.round_done(replies.round_k, accepted, len(tokens), self.draft_len)
            events.append(self._deliver(seq, tokens, rec, failure))
            self.metrics.committed(replies.round_k, accepted, len(events[-1].token_ids), kept)
            self._index(seq, held)
            if seq.done:
                finished.append(seq)
        return events + self._retire(finished)

    def _index(self, seq: Sequence, cached: int) -> None:
        """Index the sequence's full blocks below `cached` (every rank holds their KV); its
        token list is built only when a new block is full (most rounds complete none)."""
        if cached // self.blocks.block_size > len(seq.table.keys):
            self.blocks.register(seq.table, seq.tokens, cached)

    def _deliver(
        self, seq: Sequence, tokens: list[int], records: list[list[float]], failure: str = ""
    ) -> Event:
        """Committed tokens (and their logprob records, if asked) to the sequence's output,
        up to its limits and stops; none where its grammar failed (`failure`: it ends)."""
        if failure:
            seq.fail(failure)
            return Event(EventKind.DELTA, seq, [], "")
        room = seq.params.max_new_tokens - len(seq.generated)
        new = tokens[:room]
        stop_token = False
        for i, tok in enumerate(new):
            if tok in seq.stop_ids:
                new, stop_token = new[: i + 1], True
                seq.finish("stop")
                break
        checks = len(seq.generated) + len(new) >= seq.params.min_tokens
        new, stopped = seq.stream.add(new, check=checks, last_is_stop=stop_token)
        if stopped:
            seq.finish("stop")
        if new:
            stats, now = seq.stats, time.perf_counter()
            if stats.t_first is None:
                stats.t_first = now
                self.metrics.first_token(now - stats.t_start)
            else:
                self.metrics.delivered(now - (stats.t_last or now), len(new))
            stats.t_last = now
        seq.generated.extend(new)
        logprobs = seq.take_logprobs(new, records) if seq.logprobs is not None else None
        if not seq.done and len(seq.generated) >= seq.params.max_new_tokens:
            seq.finish("length")
        return Event(EventKind.DELTA, seq, new, seq.stream.delta(final=seq.done), logprobs)

    def _retire(self, seqs: list[Sequence]) -> list[Event]:
        events = []
        for seq in seqs:
            self._free(seq)
            seq.stats.t_end = time.perf_counter()
            self.metrics.finished(seq.finish_reason or "stop", seq.stats.t_end - seq.stats.t_start)
            events.append(Event(EventKind.FINAL, seq, [], ""))
        return events
