"""A request's sequence as the scheduler tracks it: prompt, sampling, what it generated, its
KV blocks (runtime.serving.block_manager.BlockTable) while it runs, and its statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.params import SamplingParams
from runtime.serving.block_manager import BlockTable
from runtime.serving.textstream import TextStream


@dataclass
class Sequence:
    request_id: str
    index: int  # position in the request's list of prompts
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    rounds: int = 0
    target_only_rounds: int = 0  # rounds without a draft (draft_len auto, k = 0)
    overlapped_rounds: int = 0  # rounds whose window was drafted during the last verify
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    tested: int = 0  # draft tokens tested (every token up to the first reject)
    emitted_per_round: list[int] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when the first generated token was committed
    t_last: float | None = None  # when generated tokens were last committed
    t_end: float | None = None
    cancelled: bool = False
    seed: int = 0  # the request's seed, or one drawn for it
    accepted_at: list[int] = field(default_factory=list)  # rounds that kept draft token i+1
    table: BlockTable = field(default_factory=BlockTable)  # its KV blocks while it runs
    cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the cache
    admitted: int = 0  # admission order (the newest is preempted first)
    prefill_at: int = 0  # positions cached: where its prompt's next chunk starts
    ready: bool = False  # its prefill is done (its first token came): it runs
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what a (re)admission prefills (a new list)."""
        return self.prompt_ids + self.generated

    @property
    def length(self) -> int:
        """len(tokens), without building them."""
        return len(self.prompt_ids) + len(self.generated)

    def worker_params(self) -> dict:
        p = self.params
        return {
            "temperature": float(p.temperature),
            "top_k": int(p.top_k or 0),
            "top_p": float(p.top_p),
            "seed": self.seed,
        }

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
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "preemptions": self.preemptions,
            "time_to_first_token_s": None if self.t_first is None else self.t_first - self.t_start,
        }

    def output(self) -> dict:
        return {
            "index": self.index,
            "text": self.stream.text,
            "token_ids": self.generated,
            "finish_reason": self.finish_reason,
            "stats": self.stats(),
        }


@dataclass
class Event:
    kind: str  # "delta" | "final"
    seq: Sequence
    token_ids: list[int]
    text: str
