"""The adaptive draft length converges to the k that maximises expected tokens/s."""
from __future__ import annotations

import random

import pytest

from runtime.adaptive import DraftLenController, expected_tokens

pytestmark = pytest.mark.timeout(30)


def best_k(alpha: float, t_verify: float, t_draft: float, max_k: int) -> int:
    return max(range(1, max_k + 1),
               key=lambda k: expected_tokens(alpha, k) / (t_verify + k * t_draft))


def simulate(alpha: float, t_verify: float, t_draft: float, rounds: int = 600,
             batch: int = 2) -> list[int]:
    rng = random.Random(0)
    ctl = DraftLenController(None, max_k=8)
    chosen = []
    for _ in range(rounds):
        k = ctl.choose(batch)
        accepted = []
        for _ in range(batch):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            accepted.append(a)
        ctl.observe(k, accepted, t_verify + k * t_draft + rng.uniform(0, 0.01 * t_verify))
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("alpha,t_verify,t_draft", [
    (0.9, 1.0, 0.05),     # good draft, cheap: long proposals
    (0.6, 1.0, 0.1),
    (0.1, 1.0, 0.3),      # poor draft: k = 1
])
def test_converges_to_the_best_k(alpha, t_verify, t_draft):
    chosen = simulate(alpha, t_verify, t_draft)
    target = best_k(alpha, t_verify, t_draft, 8)
    tail = chosen[-200:]
    assert max(set(tail), key=tail.count) == target
    assert tail.count(target) > 0.8 * len(tail)


def test_fixed_draft_len_is_kept():
    ctl = DraftLenController(3, max_k=3)
    for _ in range(5):
        assert ctl.choose(4) == 3
        ctl.observe(3, [0, 3, 1, 2], 0.1)


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
