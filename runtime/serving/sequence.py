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
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: EOS unless ignored, and
    # stop_token_ids (the workers mask them until min_tokens were generated)
    logprobs: list[dict[int, float]] | None = None  # per generated token, when asked
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, ditto
    grammar: tuple[str, str, str] = ("", "", "")  # its structured output: kind, text, wire
    grammar_vocab: str = ""  # the vocabulary the workers need for it, until they have it
    error: str = ""  # why it ended without a result (its grammar's matcher failed)

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

    def fail(self, why: str) -> None:
        """End without a result: its request is answered with this error (a ValueError
        naming structured_outputs; runtime.serving.server)."""
        done = len(self.generated)
        self.error = f"structured_outputs: the grammar failed after {done} tokens: {why}"
        self.finish("error")

    def worker_params(self) -> Sampling:
        """What the workers sample this sequence with."""
        p = self.params
        penalised = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
        kept = penalised or self.grammar[0]  # the output so far reaches a readmission's workers
        return Sampling(
            float(p.temperature),
            int(p.top_k or 0),
            float(p.top_p),
            self.seed,
            min_p=float(p.min_p),
            bias_ids=[t for t, _ in p.logit_bias],
            bias_values=[float(b) for _, b in p.logit_bias],
            min_tokens=p.min_tokens,
            stop_ids=sorted(self.stop_ids) if p.min_tokens else [],
            output_start=len(self.prompt_ids),
            repetition=float(p.repetition_penalty),
            frequency=float(p.frequency_penalty),
            presence=float(p.presence_penalty),
            prompt=list(self.prompt_ids) if penalised else [],
            output=list(self.generated) if kept else [],
            logprobs=-1 if p.logprobs is None else p.logprobs,
            prompt_logprobs=-1 if p.prompt_logprobs is None else p.prompt_logprobs,
            grammar_kind=self.grammar[0],
            grammar_text=self.grammar[1],
            grammar_wire=self.grammar[2],
            grammar_vocab=self.grammar_vocab,
        )

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    def take_prompt_logprobs(self, start: int, records: list[list[float]]) -> None:
        """A prefill chunk's records of the tokens at positions start, start + 1, ... (those
        past the prompt, a readmitted sequence's output, are not prompt tokens)."""
        if self.prompt_logprobs is None:
            return
        top = self.params.prompt_logprobs or 0
        for pos, rec in enumerate(records, start):
            if pos >= len(self.prompt_ids):
                break
            self.prompt_logprobs[pos] = _entry(self.prompt_ids[pos], rec, top)

    def take_logprobs(
        self, tokens: list[int], records: list[list[float]]
    ) -> list[dict[int, float]]:
        """The workers' records of tokens this sequence kept (one each, in order) as
        {token id: logprob}: the chosen token's, then its top `logprobs` alternatives."""
        top = self.params.logprobs
        if top is None or self.logprobs is None:
            return []
        kept = [_entry(token, rec, top) for token, rec in zip(tokens, records)]
        self.logprobs.extend(kept)
        return kept

    def output(self) -> dict:
        out = {
            "index": self.index,
            "text": self.stream.text,
            "token_ids": self.generated,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(len(self.prompt_ids), len(self.generated)),
        }
        if self.logprobs is not None:
            out["logprobs"] = pairs(self.logprobs)
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [
                None if e is None else [[t, lp] for t, lp in e.items()]
                for e in self.prompt_logprobs
            ]
        return out


def _entry(token: int, rec: list[float], top: int) -> dict[int, float]:
    """A worker's record (runtime.speculation.processors.token_logprobs) as {token id:
    logprob}: the chosen token's, then its first `top` alternatives."""
    width = (len(rec) - 1) // 2
    entry = {token: rec[0]}
    for alt, logprob in zip(rec[1 : 1 + top], rec[1 + width : 1 + width + top]):
        entry.setdefault(int(alt), logprob)
    return entry


def pairs(entries: list[dict[int, float]]) -> list[list[list[float]]]:
    """{token id: logprob} per token as [[id, logprob], ...] (msgpack maps need str keys)."""
    return [[[token, lp] for token, lp in entry.items()] for entry in entries]


class EventKind(Enum):
    DELTA = "delta"  # new tokens (and text) of a running sequence
    FINAL = "final"  # the sequence ended: its output is complete


@dataclass
class Event:
    kind: EventKind
    seq: Sequence
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when asked
