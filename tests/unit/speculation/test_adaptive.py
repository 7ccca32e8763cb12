"""The adaptive draft length converges to the k that maximises expected tokens/s."""

from __future__ import annotations

import random

import pytest

from runtime.speculation.adaptive import (
    TARGET_ONLY_STEPS,
    DraftLenController,
    expected_tokens,
    expected_tokens_by_position,
)

pytestmark = pytest.mark.timeout(30)

DECAYING = [0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.2]  # conditional acceptance by position


def linear(t_verify: float, t_draft: float, overhead: float = 0.0):
    """Round cost: verify + k drafts; a target-only round (k = 0) of `steps` decode steps
    pays the per-round overhead once."""

    def cost(k: int, steps: int = 1) -> float:
        if k == 0:
            return overhead + steps * (t_verify - overhead)
        return t_verify + k * t_draft

    return cost


def stepped(k: int, steps: int = 1) -> float:
    """A verify shape that costs more from k = 5 on, with a fixed per-round overhead."""
    return steps * 1.0 if k == 0 else (1.0 if k <= 4 else 1.5) + 0.06 * k


def best_k(accept: list[float], cost, max_k: int = 8) -> int:
    """The k (0 = target-only) with the most expected tokens per second under the true
    model."""
    expected = [float(TARGET_ONLY_STEPS)] + expected_tokens_by_position(accept)
    rates = [e / cost(k, TARGET_ONLY_STEPS if k == 0 else 1) for k, e in enumerate(expected)]
    return rates.index(max(rates))


def simulate(
    accept: list[float], cost, rounds: int = 600, batch: int = 2, early: bool = False
) -> tuple[list[int], DraftLenController]:
    """Run the controller against per-position acceptance `accept` and round cost `cost`;
    `early`: each round's k is chosen before the previous round is observed, as the
    scheduler does (runtime.serving.scheduler.Scheduler._draft_lens)."""
    rng = random.Random(0)
    ctl = DraftLenController(None, max_k=8)
    chosen, next_k = [], ctl.choose(batch) if early else None
    for _ in range(rounds):
        k, next_k = (next_k, ctl.choose(batch)) if early else (ctl.choose(batch), None)
        accepted = []
        for _ in range(batch):
            a = 0
            while a < k and rng.random() < accept[a]:
                a += 1
            accepted.append(a)
        steps = TARGET_ONLY_STEPS if k == 0 else 1
        ctl.observe(k, accepted, cost(k, steps) * (1 + rng.uniform(0, 0.01)), steps)
        chosen.append(k)
    return chosen, ctl


def assert_converged(chosen: list[int], target: int, share: float) -> None:
    tail = chosen[-200:]
    assert max(set(tail), key=tail.count) == target
    assert tail.count(target) > share * len(tail)


@pytest.mark.parametrize(
    "alpha,t_verify,t_draft",
    [
        (0.9, 1.0, 0.05),  # good draft, cheap: long proposals
        (0.6, 1.0, 0.1),
        (0.3, 1.0, 0.1),  # weak draft: k = 1
        (0.1, 1.0, 0.3),  # poor draft: target-only rounds (k = 0)
    ],
)
@pytest.mark.parametrize("early", [False, True], ids=["now", "a-round-early"])
def test_converges_to_the_best_k(alpha, t_verify, t_draft, early):
    chosen, _ = simulate([alpha] * 8, linear(t_verify, t_draft), early=early)
    assert_converged(chosen, best_k([alpha] * 8, linear(t_verify, t_draft)), 0.8)


@pytest.mark.parametrize("batch", [1, 2])
def test_position_dependent_acceptance(batch):
    """Acceptance that decays along the draft: per-position estimates find the best k,
    where one pooled i.i.d. alpha would propose longer drafts."""
    cost = linear(1.0, 0.1)
    chosen, ctl = simulate(DECAYING, cost, batch=batch)
    target = best_k(DECAYING, cost)
    assert_converged(chosen, target, 0.75)
    pooled_rule = best_k([ctl.alpha] * 8, cost)  # the geometric model on what was seen
    assert pooled_rule > target


def test_cost_not_linear_in_k():
    """A step in the round cost: measured per-k costs find the best k a line misses."""
    chosen, _ = simulate([0.8] * 8, stepped)
    assert_converged(chosen, best_k([0.8] * 8, stepped), 0.75)


def test_fixed_draft_len_is_kept():
    ctl = DraftLenController(3, max_k=3)
    for _ in range(5):
        assert ctl.choose(4) == 3
        ctl.observe(3, [0, 3, 1, 2], 0.1)


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens_by_position([0.5, 0.5]) == [1.5, 1.75]
    assert expected_tokens_by_position([1.0, 0.0, 1.0]) == [2.0, 2.0, 2.0]


def test_target_only_rounds_amortise_the_overhead():
    """A poor draft: the line's intercept (one verify with its control overhead) makes a
    target-only step look close to k = 1, so it is measured; measured, its amortised
    overhead makes it the best, and k = 1 is still probed now and then."""
    cost = linear(1.0, 0.05, overhead=0.3)
    assert best_k([0.15] * 8, cost) == 0 and cost(1) / 1.15 < 1.0  # k = 1 beats 1 / verify
    chosen, _ = simulate([0.15] * 8, cost)
    assert_converged(chosen, 0, 0.8)
    assert 1 in chosen[-200:]


@pytest.mark.parametrize("slow", [1.0, 3.0, 10.0])
@pytest.mark.parametrize("early", [False, True], ids=["now", "a-round-early"])
def test_one_slow_round_does_not_keep_a_useless_draft_drafting(slow, early):
    """A draft that is never right, and a first round `slow` times its cost (a warm-up):
    target-only rounds from the first round after the two k values explored first are
    measured (through single observations, the slow short round flattened the line, and
    the longest k looked best for dozens of rounds)."""
    rounds, cost = [], linear(1.0, 0.3)

    def slow_first(k: int, steps: int = 1) -> float:
        rounds.append(k)
        return cost(k, steps) * (slow if len(rounds) == 1 else 1.0)

    chosen, _ = simulate([0.0] * 8, slow_first, rounds=64, batch=3, early=early)
    explored = 2 * 3 + early  # MIN_COST_OBS rounds of two k
    assert set(chosen[: explored - early]) == {2, 6}
    assert chosen[explored] == 0 and chosen[explored:].count(0) > 0.8 * (64 - explored)


def test_good_draft_never_runs_target_only():
    chosen, _ = simulate([0.85] * 8, linear(1.0, 0.1, overhead=0.3))
    assert 0 not in chosen


class RecordingPool:
    """Stands in for the workers: records commands, answers rounds with drafts accepted at
    `accept` per position (seeded)."""

    def __init__(self, accept: list[float]):
        self.commands, self.accept, self.rng = [], accept, random.Random(1)

    def command(self, cmd, timeout_s: float) -> dict:
        from runtime.control import commands

        self.commands.append(cmd)
        if isinstance(cmd, commands.PrefillCommand):  # each sequence's first token
            n = len(cmd.slots)
            return {
                0: commands.RoundReply(
                    commands.TARGET_LEADER, 0.0, tokens=[[7]] * n, accepted=[0] * n
                )
            }
        if not isinstance(cmd, commands.RoundCommand):
            return {0: commands.StepAck()}
        accepted, tokens = [], []
        for _ in cmd.slots:
            a = 0
            while a < cmd.k and self.rng.random() < self.accept[a]:
                a += 1
            accepted.append(a)
            tokens.append([7] * (cmd.steps if cmd.k == 0 else a + 1))
        reply = commands.RoundReply(commands.TARGET_LEADER, 0.0, tokens=tokens, accepted=accepted)
        return {0: reply}


def test_each_round_runs_the_k_sent_ahead_with_the_one_before():
    """The scheduler chooses each round's k a round early and sends it with the round before
    (next_k), so the workers draft ahead (or decode ahead) exactly what the next round runs;
    when the batch changes, the k is chosen afresh."""
    from runtime.params import SamplingParams
    from runtime.serving.executor import Executor, run_step
    from runtime.serving.scheduler import Scheduler, Sequence
    from runtime.serving.textstream import TextStream

    pool = RecordingPool([0.7] * 8)
    sched = Scheduler(num_slots=2, draft_len=None, eos_token_ids=())
    executor = Executor(pool, 5.0, sched.metrics)  # type: ignore[arg-type]
    for i, n in enumerate((150, 300)):
        sched.add(
            Sequence(
                "r", i, [1, 2, 3], SamplingParams.from_kwargs(max_new_tokens=n), TextStream(None)
            )
        )
    while sched.has_work:
        run_step(sched, executor)
    rounds = [c for c in pool.commands if c.NAME == "round"]
    pairs = list(zip(rounds, rounds[1:]))
    assert all(0 <= c.next_k <= 8 for c in rounds)
    assert all(b.k == a.next_k for a, b in pairs if a.slots == b.slots)
    assert any(a.slots != b.slots for a, b in pairs)  # one finished first
    assert len({c.k for c in rounds}) > 1  # k did change
