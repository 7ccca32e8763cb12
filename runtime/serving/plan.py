"""One scheduler step as data: what the scheduler decided (StepPlan, from Scheduler.schedule)
and what the workers answered (StepReplies, for Scheduler.update). The orchestrator's executor
(runtime.serving.executor) turns a plan into commands on the worker pool, in this order:

1. `releases`: the slots of sequences that ended or were preempted since the last step;
2. `prefill`: this step's prompt chunks, each with its sequence's block table;
3. `round`: one speculation round of the sequences that decode, with k drafts each, the next
   round's k announced ahead, and each row's new blocks.

A sequence whose last prompt chunk is in `prefill` is in `round` too (the workers hold its first
token by then, and the scheduler has delivered it: executor.run_step); one that ends at that
first token has its round's tokens dropped by Scheduler.rounded.

Per-request sampling state that later work adds travels here, a row at a time: what a prefill
row samples with is `PrefillChunk.seq.worker_params()`, and a round's rows are `RoundPlan.seqs`
(logprobs wanted, penalties' counts and a grammar's mask are the rows' Sequence state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.control import commands
from runtime.serving.sequence import Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    tokens: list[int]  # its tokens from seq.prefill_at on
    final: bool  # they end its prompt (the target then picks its first token)
    cached: int  # positions before them already in its blocks (seq.prefill_at)


@dataclass
class RoundPlan:
    seqs: list[Sequence]  # in slot order
    slots: list[int]  # theirs when planned (one ending at its first token gives its up)
    k: int  # drafts per row (0: the target alone, `steps` decode steps)
    next_k: int  # the next round's k, worked on ahead
    steps: int
    growth: list[list[int]]  # per row, the blocks its table grows by first

    def command(self) -> commands.RoundCommand:
        return commands.RoundCommand(self.slots, self.k, self.next_k, self.steps, self.growth)


@dataclass
class StepPlan:
    releases: list[int] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    round: RoundPlan | None = None

    @property
    def empty(self) -> bool:
        return not (self.releases or self.prefill or self.round)

    def release_command(self) -> commands.ReleaseCommand | None:
        return commands.ReleaseCommand(list(self.releases)) if self.releases else None

    def prefill_command(self) -> commands.PrefillCommand | None:
        if not self.prefill:
            return None
        return commands.PrefillCommand(
            [c.seq.slot for c in self.prefill],  # type: ignore[misc]  # admitted: a slot
            [c.tokens for c in self.prefill],
            [c.seq.worker_params() for c in self.prefill],
            [c.cached for c in self.prefill],
            [list(c.seq.table.blocks) for c in self.prefill],
            [c.final for c in self.prefill],
        )


@dataclass
class StepReplies:
    """The workers' answers to a plan: the reporting leader's verdict of the prefill and of the
    round (tokens per row), the positions every rank caches per row, and what they cost."""

    prefill: commands.RoundReply | None = None
    prefill_cached: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    round: commands.RoundReply | None = None
    round_cached: list[int] = field(default_factory=list)
    round_cost_s: float = 0.0
    round_k: int = 0  # proposals verified per row (the most; a cross round may verify fewer)
    round_steps: int = 1  # decode steps the round took (a cross round: one)
