"""The scheduler on plain data: schedule() -> StepPlan, replies built by hand, update(plan,
replies) -> events. No pool, no executor, no simulated workers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.control.commands import TARGET_LEADER, RoundReply
from runtime.params import SamplingParams
from runtime.serving.block_manager import BlockManager
from runtime.serving.plan import StepPlan, StepReplies
from runtime.serving.scheduler import Scheduler
from runtime.serving.sequence import EventKind, SeqStatus, Sequence
from runtime.serving.textstream import TextStream

pytestmark = pytest.mark.timeout(60)

EOS = 2


def seq(rid: str, prompt: list[int], max_new: int) -> Sequence:
    params = SamplingParams.from_kwargs(max_new_tokens=max_new)
    return Sequence(rid, 0, list(prompt), params, TextStream(None))


def scheduler(num_blocks: int = 64, slots: int = 4, **kwargs) -> Scheduler:
    return Scheduler(
        slots, 3, (EOS,), blocks=BlockManager(num_blocks, 4, True), table_len=96, **kwargs
    )


def replies(
    plan: StepPlan,
    first: list[int] | None = None,
    rows: list[list[int]] | None = None,
    accepted: list[int] | None = None,
) -> StepReplies:
    """What the workers would answer: `first` token per prefill row (0 for a chunk), `rows`
    of tokens per round row with `accepted` drafts kept, every position cached."""
    out = StepReplies()
    if plan.prefill:
        firsts = first or [7] * len(plan.prefill)
        out.prefill = RoundReply(
            TARGET_LEADER,
            0.0,
            tokens=[[t] if c.final else [] for t, c in zip(firsts, plan.prefill)],
            accepted=[0] * len(plan.prefill),
        )
        out.prefill_cached = [
            c.cached + len(c.tokens) - (0 if c.final else 1) for c in plan.prefill
        ]
    if plan.round is not None:
        n = len(plan.round.seqs)
        rows = rows or [[9]] * n
        out.round = RoundReply(TARGET_LEADER, 0.0, tokens=rows, accepted=accepted or [0] * n)
        out.round_cached = [s.length + len(r) - 1 for s, r in zip(plan.round.seqs, rows)]
        out.round_k = plan.round.k
    return out


def test_a_new_request_is_prefilled_and_joins_the_round_of_the_same_step():
    sched = scheduler()
    a = seq("a", [10, 11, 12, 13, 14], 8)
    sched.add(a)
    plan = sched.schedule()
    assert plan.releases == [] and [c.seq for c in plan.prefill] == [a]
    chunk = plan.prefill[0]
    assert chunk.tokens == a.prompt_ids and chunk.final and chunk.cached == 0
    assert plan.round is not None and plan.round.seqs == [a] and plan.round.k == 3
    command = plan.prefill_command()
    assert command is not None and command.tables == [a.table.blocks] and command.slots == [0]
    events = sched.update(plan, replies(plan, first=[20], rows=[[21, 22, 23]], accepted=[2]))
    assert [(e.kind, e.token_ids) for e in events] == [
        (EventKind.DELTA, [20]),
        (EventKind.DELTA, [21, 22, 23]),
    ]
    assert a.generated == [20, 21, 22, 23] and a.status is SeqStatus.RUNNING
    assert a.stats.rounds == 1 and a.stats.accepted == 2 and a.stats.proposed == 3


def test_an_ended_request_is_told_at_once_and_released_in_the_next_plan():
    sched = scheduler()
    a = seq("a", [10, 11, 12], 3)
    sched.add(a)
    plan = sched.schedule()
    events = sched.update(plan, replies(plan, first=[20], rows=[[21, 22, 23]]))
    assert [e.kind for e in events] == [EventKind.DELTA, EventKind.DELTA, EventKind.FINAL]
    assert a.generated == [20, 21, 22] and a.finish_reason == "length"
    assert sched.blocks.used == 0 and sched.has_work  # books free; the workers not yet
    plan = sched.schedule()
    assert plan.releases == [0] and not plan.prefill and plan.round is None
    assert sched.update(plan, StepReplies()) == [] and not sched.has_work


def test_one_new_token_left_skips_the_round_and_eos_drops_its_tokens():
    sched = scheduler()
    one, eos = seq("one", [10, 11], 1), seq("eos", [12, 13], 9)
    sched.add(one)
    sched.add(eos)
    plan = sched.schedule()
    assert plan.round is not None and plan.round.seqs == [eos]  # `one` ends at its first
    events = sched.update(plan, replies(plan, first=[20, EOS], rows=[[30, 31]]))
    assert one.generated == [20] and one.finish_reason == "length"
    assert eos.generated == [EOS] and eos.finish_reason == "stop"  # the round's dropped
    assert [e.kind for e in events].count(EventKind.FINAL) == 2
    assert sorted(sched.schedule().releases) == [0, 1]


def test_a_cancelled_request_ends_with_a_final_and_its_slot_is_released():
    sched = scheduler()
    a, b = seq("a", [10, 11, 12], 50), seq("b", [14, 15], 50)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.update(plan, replies(plan))
    sched.cancel("a")
    assert a.status is SeqStatus.CANCELLED
    plan = sched.schedule()
    assert plan.releases == [0] and plan.round is not None and plan.round.seqs == [b]
    events = sched.update(plan, replies(plan))
    assert (events[0].kind, events[0].seq) == (EventKind.FINAL, a)
    assert a.finish_reason == "cancelled" and a.slot is None


def test_the_budget_chunks_a_prompt_and_running_requests_get_a_round_between_chunks():
    sched = scheduler(max_prefill_tokens=4)
    a = seq("a", [10, 11, 12], 50)
    sched.add(a)
    plan = sched.schedule()
    sched.update(plan, replies(plan))
    long = seq("long", list(range(100, 111)), 5)
    sched.add(long)
    sizes = []
    while long.status is not SeqStatus.RUNNING:
        plan = sched.schedule()
        sizes.append([len(c.tokens) for c in plan.prefill])
        assert plan.round is not None and a in plan.round.seqs  # a round every step
        sched.update(plan, replies(plan))
    assert sizes == [[4], [4], [4], [2]]  # each chunk's last token starts the next
    assert long.prefill_at == 10 and long.generated == [7, 9]  # its first, then a round


def test_the_newest_is_preempted_when_the_running_cannot_grow():
    sched = scheduler(num_blocks=20, slots=2)
    a, b = seq("a", [10, 11, 12], 60), seq("b", [14, 15, 16], 60)
    for s in (a, b):
        sched.add(s)
    preempted, slot_of_b = None, None
    for _ in range(40):
        slot_of_b = b.slot
        plan = sched.schedule()
        if plan.releases:
            preempted = plan.releases
            break
        sched.update(plan, replies(plan, rows=[[9, 9, 9, 9]] * len(plan.round.seqs)))
    assert preempted == [slot_of_b] == [1] and b.status is SeqStatus.WAITING
    assert b.stats.preemptions == 1 and list(sched.queue) == [b] and a.slot == 0


def test_a_grammar_that_failed_on_the_workers_ends_its_sequence_with_the_error():
    """The target leader reports a slot's failed grammar (its round committed a stop token
    under stop-only masks): the sequence takes none of the round's tokens, fails with the
    reason, its final comes at once and its slot is released; the others go on."""
    sched = scheduler()
    a, b = seq("a", [10, 11, 12], 8), seq("b", [13, 14, 15], 8)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    first = replies(plan, first=[20, 30], rows=[[21, 22], [31, 32]])
    assert first.round is not None
    first.round = replace(first.round, grammar_failures=["", "lexer error: too many states"])
    events = sched.update(plan, first)
    assert a.generated == [20, 21, 22] and not a.done and not a.error
    assert b.generated == [30] and b.finish_reason == "error"
    assert b.error == (
        "structured_outputs: the grammar failed after 1 tokens: lexer error: too many states"
    )
    assert [e.seq for e in events if e.kind is EventKind.FINAL] == [b]
    assert sched.schedule().releases == [1]
