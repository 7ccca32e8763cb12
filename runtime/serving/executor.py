"""The orchestrator's hands: a StepPlan (runtime.serving.plan) carried out on the worker pool,
its commands in the plan's order (release, prefill, round), the replies checked and gathered
for Scheduler.update. A draft with another tokenizer runs its rounds through a second executor
(runtime.serving.cross_round.CrossExecutor), which overrides `_round` only."""

from __future__ import annotations

import time

from runtime.control import commands, protocol
from runtime.control.pool import WorkerPool
from runtime.serving.metrics import ServingMetrics
from runtime.serving.plan import RoundPlan, StepPlan, StepReplies


class Executor:
    def __init__(self, pool: WorkerPool, step_timeout_s: float, metrics: ServingMetrics):
        self.pool = pool
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics  # the round's timings (the scheduler keeps the counts)

    def run(self, plan: StepPlan) -> StepReplies:
        replies = StepReplies()
        release = plan.release_command()
        if release is not None:
            for result in self.send(release).values():
                commands.expect(result, commands.StepAck)
        prefill = plan.prefill_command()
        if prefill is not None:
            start = time.perf_counter()
            answers = round_replies(self.send(prefill))
            replies.prefill_s = time.perf_counter() - start
            replies.prefill = leader(answers)
            replies.prefill_cached = cached(answers, len(plan.prefill))
        if plan.round is not None:
            self._round(plan.round, replies, self._firsts(plan, replies))
        return replies

    @staticmethod
    def _firsts(plan: StepPlan, replies: StepReplies) -> dict[int, int]:
        """slot -> the first token of each prompt that ended in this step's prefill (its
        Sequence has it only after Scheduler.update)."""
        if replies.prefill is None:
            return {}
        return {
            chunk.seq.slot: tokens[0]  # type: ignore[misc]  # admitted: a slot
            for chunk, tokens in zip(plan.prefill, replies.prefill.tokens)
            if chunk.final and tokens
        }

    def send(self, command: commands.Command) -> dict[int, commands.Reply]:
        """One step command to every worker; each rank's reply."""
        return self.pool.command(command, self.step_timeout_s)

    def _round(self, plan: RoundPlan, replies: StepReplies, firsts: dict[int, int]) -> None:
        """The round; `firsts`: first tokens of the rows that join it (the workers have
        them)."""
        start = self.metrics.round_begins()
        self._took_round(replies, start, self.send(plan.command()), plan.k, len(plan.seqs))
        replies.round_steps = plan.steps

    def _took_round(
        self,
        replies: StepReplies,
        start: float,
        results: dict[int, commands.Reply],
        k: int,
        rows: int,
    ) -> None:
        """A round's results (k: proposals verified per row, the most) into `replies`."""
        replies.round_cost_s = self.metrics.round_ends(start, results, k)
        answers = round_replies(results)
        replies.round, replies.round_cached = leader(answers), cached(answers, rows)
        replies.round_k = k


def round_replies(results: dict[int, commands.Reply]) -> list[commands.RoundReply]:
    """A round's or a prefill's replies (one per worker rank), checked."""
    return [commands.expect(r, commands.RoundReply) for r in results.values()]


def cached(replies: list[commands.RoundReply], rows: int) -> list[int]:
    """Per row, the positions every rank holds the KV of committed tokens for (the least any
    rank reports; none reported: 0 each)."""
    reports = [r.cached for r in replies if r.cached]
    if not reports:
        return [0] * rows
    return [min(column) for column in zip(*reports)]


def leader(replies: list[commands.RoundReply]) -> commands.RoundReply:
    """The one reporting reply (the target's leader, or a cross draft's) among a command's."""
    leaders = [r for r in replies if r.reports]
    if len(leaders) != 1:
        raise protocol.ProtocolError(f"a step got {len(leaders)} leader replies")
    return leaders[0]
