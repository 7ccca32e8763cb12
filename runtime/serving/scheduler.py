"""The orchestrator's scheduler: admits requests into KV slots, runs speculation rounds on
the workers, appends accepted tokens, checks stop conditions and retires finished requests
(in-flight batching: requests join and leave between rounds)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from runtime.speculation.adaptive import TARGET_ONLY_STEPS, DraftLenController, takes_bonus
from runtime.config.schema import MAX_AUTO_DRAFT_LEN
from runtime.params import SamplingParams
from runtime.control import protocol
from runtime.control.pool import WorkerPool
from runtime.serving.metrics import ServingMetrics
from runtime.serving.textstream import TextStream


@dataclass
class Sequence:
    request_id: str
    index: int                       # position in the request's list of prompts
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    rounds: int = 0
    target_only_rounds: int = 0      # rounds without a draft (draft_len auto, k = 0)
    overlapped_rounds: int = 0       # rounds whose window was drafted during the last verify
    proposed: int = 0                # draft tokens proposed
    accepted: int = 0                # draft tokens accepted
    tested: int = 0                  # draft tokens tested (every token up to the first reject)
    emitted_per_round: list[int] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None     # when the first generated token was committed
    t_last: float | None = None      # when generated tokens were last committed
    t_end: float | None = None
    cancelled: bool = False
    seed: int = 0                    # the request's seed, or one drawn for it
    accepted_at: list[int] = field(default_factory=list)  # rounds that kept draft token i+1

    def worker_params(self) -> dict:
        p = self.params
        return {"temperature": float(p.temperature), "top_k": int(p.top_k or 0),
                "top_p": float(p.top_p), "seed": self.seed}

    def stats(self) -> dict:
        elapsed = (self.t_end or time.perf_counter()) - self.t_start
        rounds = max(self.rounds, 1)
        return {
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_accepted_tokens": sum(self.emitted_per_round) / rounds if self.rounds else 0.0,
            "rounds": self.rounds,
            "target_only_rounds": self.target_only_rounds,
            "overlapped_rounds": self.overlapped_rounds,
            "tokens_per_s": len(self.generated) / elapsed if elapsed > 0 else 0.0,
            "accepted_per_position": list(self.accepted_at),
            "tested_draft_tokens": self.tested,
            "prompt_tokens": len(self.prompt_ids),
            "time_to_first_token_s": None if self.t_first is None else
            self.t_first - self.t_start,
        }

    def output(self) -> dict:
        return {"index": self.index, "text": self.stream.text, "token_ids": self.generated,
                "finish_reason": self.finish_reason, "stats": self.stats()}


@dataclass
class Event:
    kind: str          # "delta" | "final"
    seq: Sequence
    token_ids: list[int]
    text: str


class Scheduler:
    def __init__(self, pool: WorkerPool, num_slots: int, draft_len: int | None,
                 eos_token_ids: tuple[int, ...], step_timeout_s: float,
                 overlap: bool = False, acceptance: str = "tokens"):
        self.pool = pool
        self.draft_len = MAX_AUTO_DRAFT_LEN if draft_len is None else draft_len  # max k
        self.controller = DraftLenController(draft_len, MAX_AUTO_DRAFT_LEN, overlap)
        self.overlap = overlap   # workers draft the next window during verification
        self.acceptance = acceptance
        self.eos = set(eos_token_ids)
        self.step_timeout_s = step_timeout_s
        self.free_slots = list(range(num_slots))
        self.queue: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.metrics = ServingMetrics()
        self.next_k: int | None = None      # the next round's k, sent ahead with this one
        self.next_slots: list[int] = []     # ... for these slots

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
        self._admit()
        if not self.running:
            self.metrics.idle()
            return events
        slots = sorted(self.running)
        k, next_k = self._draft_lens(slots)
        steps = 1
        if k == 0:   # target-only: several decode steps on one command, none past a limit
            steps = min(TARGET_ONLY_STEPS, *(self.running[s].params.max_new_tokens -
                                             len(self.running[s].generated) for s in slots))
        command = protocol.RoundCommand(slots, k, next_k, steps)
        start = self.metrics.round_begins()
        results = self.pool.command(command.to_msg(), self.step_timeout_s)
        cost = self.metrics.round_ends(start, results, k)
        verdict = _verdict(results)
        finished = []
        self.controller.observe(k, verdict.accepted, cost, steps)
        overlapped = verdict.overlapped or [False] * len(slots)
        for slot, tokens, accepted, kept in zip(slots, verdict.tokens, verdict.accepted,
                                                overlapped):
            seq = self.running[slot]
            seq.overlapped_rounds += kept
            events.append(self._append(seq, tokens, accepted, k, kept))
            if seq.finish_reason is not None:
                finished.append(seq)
        events.extend(self._retire(finished))
        return events

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
        admitted = []
        while self.queue and self.free_slots:
            seq = self.queue.popleft()
            seq.slot = self.free_slots.pop(0)
            self.running[seq.slot] = seq
            admitted.append(seq)
        if admitted:
            start = time.perf_counter()
            command = protocol.PrefillCommand([s.slot for s in admitted],
                                              [s.prompt_ids for s in admitted],
                                              [s.worker_params() for s in admitted])
            self.pool.command(command.to_msg(), self.step_timeout_s)
            self.metrics.prefill_done(time.perf_counter() - start,
                                      sum(len(s.prompt_ids) for s in admitted))

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
        self.metrics.committed(k, accepted, len(new), overlapped)
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
        self.pool.command(protocol.ReleaseCommand(slots).to_msg(), self.step_timeout_s)
        events = []
        for seq in seqs:
            del self.running[seq.slot]
            self.free_slots.append(seq.slot)
            seq.t_end = time.perf_counter()
            self.metrics.finished(seq.finish_reason, seq.t_end - seq.t_start)
            events.append(Event("final", seq, [], ""))
        self.free_slots.sort()
        return events


def _verdict(results: dict[int, dict]) -> protocol.RoundReply:
    """The target leader's reply among a round's replies (one per worker rank)."""
    replies = [protocol.RoundReply.from_map(r) for r in results.values()]
    leaders = [r for r in replies if r.reports]
    if len(leaders) != 1:
        raise protocol.ProtocolError(f"a round got {len(leaders)} target leader replies")
    return leaders[0]
