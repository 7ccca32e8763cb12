"""A request's sequence as the scheduler tracks it: prompt, sampling, what it generated, where
it is in its life (SeqStatus), its KV blocks (runtime.serving.block_manager.BlockTable) while it
holds a slot; and beside it its statistics (SeqStats) and the events it produces."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from runtime.control.commands import Sampling
from runtime.params import SamplingParams
from runtime.serving.block_manager import BlockTable
from runtime.serving.textstream import TextStream


class SeqStatus(Enum):
    WAITING = "waiting"  # queued: new, or preempted and waiting to be readmitted
    PREFILLING = "prefilling"  # holds a slot; its prompt is prefilled chunk by chunk
    RUNNING = "running"  # its first token came: it is in every round
    CANCELLED = "cancelled"  # its client gave up: retired at the next schedule()
    FINISHED = "finished"  # ended (finish_reason says why); its slot is given back


@dataclass
class SeqStats:
    """What one sequence cost and earned (its output's `stats`)."""

    rounds: int = 0
    target_only_rounds: int = 0  # rounds without a draft (draft_len auto, k = 0)
    overlapped_rounds: int = 0  # rounds whose window was drafted during the last verify
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    tested: int = 0  # draft tokens tested (every token up to the first reject)
    emitted_per_round: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)  # rounds that kept draft token i+1
    cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the cache
    preemptions: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when the first generated token was committed
    t_last: float | None = None  # when generated tokens were last committed
    t_end: float | None = None

    def round_done(self, k: int, accepted: int, emitted: int, max_k: int) -> None:
        self.rounds += 1
        self.target_only_rounds += k == 0
        self.proposed += k
        self.accepted += accepted
        self.tested += min(accepted + 1, k)
        if len(self.accepted_at) < max_k:
            self.accepted_at.extend([0] * (max_k - len(self.accepted_at)))
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.emitted_per_round.append(emitted)

    def to_dict(self, prompt_tokens: int, generated: int) -> dict:
        elapsed = (self.t_end or time.perf_counter()) - self.t_start
        first = None if self.t_first is None else self.t_first - self.t_start
        return {
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_accepted_tokens": sum(self.emitted_per_round) / self.rounds
            if self.rounds
            else 0.0,
            "rounds": self.rounds,
            "target_only_rounds": self.target_only_rounds,
            "overlapped_rounds": self.overlapped_rounds,
            "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            "accepted_per_position": list(self.accepted_at),
            "tested_draft_tokens": self.tested,
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "preemptions": self.preemptions,
            "time_to_first_token_s": first,
        }


@dataclass
class Sequence:
    """One prompt of a request. Per-request state that sampling grows (penalties' token
    counts, a grammar matcher, logprobs kept) belongs here, beside `generated`, and reaches the
    workers through the plan's rows (runtime.serving.plan)."""

    request_id: str
    index: int  # position in the request's list of prompts
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    seed: int = 0  # the request's seed, or one drawn for it
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "cancelled", once it ended
    generated: list[int] = field(default_factory=list)
    slot: int | None = None  # its row on the workers while it holds one
    table: BlockTable = field(default_factory=BlockTable)  # its KV blocks while it holds one
    admitted: int = 0  # admission order (the newest is preempted first)
    prefill_at: int = 0  # positions cached: where its prompt's next chunk starts
    stats: SeqStats = field(default_factory=SeqStats)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what a (re)admission prefills (a new list)."""
        return self.prompt_ids + self.generated

    @property
    def length(self) -> int:
        """len(tokens), without building them."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def done(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.CANCELLED)

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = SeqStatus.FINISHED, reason

    def worker_params(self) -> Sampling:
        """What the workers sample this sequence with."""
        p = self.params
        return Sampling(float(p.temperature), int(p.top_k or 0), float(p.top_p), self.seed)

    def output(self) -> dict:
        return {
            "index": self.index,
            "text": self.stream.text,
            "token_ids": self.generated,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(len(self.prompt_ids), len(self.generated)),
        }


class EventKind(Enum):
    DELTA = "delta"  # new tokens (and text) of a running sequence
    FINAL = "final"  # the sequence ended: its output is complete


@dataclass
class Event:
    kind: EventKind
    seq: Sequence
    token_ids: list[int]
    text: str
