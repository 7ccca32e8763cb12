"""The orchestrator's hands: a StepPlan (runtime.serving.plan) carried out on the worker pool,
its commands in the plan's order (release, prefill, round), the replies checked and gathered
for the scheduler. `run_step` is one whole engine step: the prefill's events (first tokens)
leave before the round is sent, so a request's first token never waits for a round. A draft
with another tokenizer runs its rounds through a second executor
(runtime.serving.cross_round.CrossExecutor), which overrides `_round` only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.control import commands, protocol
from runtime.control.pool import WorkerPool
from runtime.serving.metrics import ServingMetrics
from runtime.serving.plan import RoundPlan, StepPlan, StepReplies
from runtime.serving.sequence import Event

if TYPE_CHECKING:
    from runtime.serving.scheduler import Scheduler


def run_step(
    scheduler: Scheduler,
    executor: Executor,
    early: Callable[[list[Event]], None] | None = None,
) -> list[Event]:
    """One engine step: the scheduler plans it, the executor releases and prefills, the
    scheduler takes the prefill (first tokens, and the ends of requests that end there), and
    `early` gets those events before the round is sent; then the round and its events.
    Without `early`, the prefill's events come first in the list returned."""
    plan = scheduler.schedule()
    replies = executor.prefill(plan)
    events = scheduler.prefilled(plan, replies)
    if early is not None and events and plan.round is not None:
        early(events)
        events = []
    executor.round(plan, replies)
    return events + scheduler.rounded(plan, replies)


class Executor:
    def __init__(self, pool: WorkerPool, step_timeout_s: float, metrics: ServingMetrics):
        self.pool = pool  # WorkerPool, or anything with its `command`
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics  # the round's timings (the scheduler keeps the counts)

    def prefill(self, plan: StepPlan) -> StepReplies:
        """The plan's releases and its prefill; the replies so far (the round's come from
        `round`, once the prefill's first tokens are out)."""
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
        return replies

    def round(self, plan: StepPlan, replies: StepReplies) -> None:
        """The plan's round, if it has one, its replies into `replies`. The sequences that
        join it from this step's prefill hold their first tokens by now (Scheduler.prefilled
        took them), as the workers do."""
        if plan.round is not None:
            self._round(plan.round, replies)

    def send(self, command: commands.Command) -> dict[int, commands.Reply]:
        """One step command to every worker; each rank's reply."""
        return self.pool.command(command, self.step_timeout_s)

    def _round(self, plan: RoundPlan, replies: StepReplies) -> None:
        """The round: one command to every worker."""
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
