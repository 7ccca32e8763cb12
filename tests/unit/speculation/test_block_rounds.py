"""Block verification over consecutive rounds, with the counter-based uniforms the engine uses.

The block rule's outcome depends on the tests and draft samples of the positions it gives
back, so those uniforms are keyed by the window (rng.window_uniform): with them the emitted
tokens follow the target (chi-square, test_sampling's toy tables); keyed by absolute position,
as the token rule's are, the next round reuses numbers the last one already looked at and the
output is visibly wrong (the negative control)."""

from __future__ import annotations

import pytest
import torch

from runtime.speculation.acceptance import accept_block, accept_rejection
from runtime.speculation.rng import (
    STREAM_ACCEPT,
    STREAM_BLOCK_ACCEPT,
    STREAM_BLOCK_DRAFT,
    STREAM_DRAFT,
    STREAM_TARGET,
    uniform,
    window_uniform,
)
from runtime.speculation.sampling import sample_from
from tests.unit.speculation.test_sampling import (
    N_EMIT,
    N_ROWS,
    K,
    _chi2_pvalue,
    _toy_tables,
    _worst_pvalue,
)

pytestmark = pytest.mark.timeout(300)


def _uniforms(seeds, start, index, by_window: bool):
    """(draft samples, acceptance tests) [N, K] for the windows starting at `start` [N]."""
    if by_window:
        return (
            window_uniform(seeds, start, index, STREAM_BLOCK_DRAFT),
            window_uniform(seeds, start, index, STREAM_BLOCK_ACCEPT),
        )
    return uniform(seeds, index, STREAM_DRAFT), uniform(seeds, index, STREAM_ACCEPT)


def _simulate(rule, P, Q, by_window: bool, rounds: int = N_EMIT):
    """Rounds of k = K drafts per row until N_EMIT tokens; returns the tokens [N, N_EMIT] and
    the mean accepted drafts per round."""
    seeds = torch.arange(N_ROWS)
    out = torch.full((N_ROWS, N_EMIT), -1)
    start = torch.zeros(N_ROWS, dtype=torch.int64)
    steps = torch.arange(K + 1)
    rows = torch.arange(N_ROWS)[:, None].expand(N_ROWS, K + 1)
    accepted = []
    for _ in range(rounds):
        index = start[:, None] + steps  # [N, K+1]
        pos = index.clamp(max=len(P) - 1)  # rows already done read the last table
        p, q = P[pos], Q[pos[:, :K]]  # [N, K+1, V], [N, K, V]
        u_draft, u_accept = _uniforms(seeds, start, index[:, :K], by_window)
        d = sample_from(q, u_draft)  # [N, K]
        a, nxt = rule(d, q, p, u_accept, uniform(seeds, index, STREAM_TARGET))
        emitted = torch.cat([d, d[:, :1]], 1).scatter(1, a[:, None], nxt[:, None])
        keep = (steps <= a[:, None]) & (index < N_EMIT)
        out[rows[keep], index[keep]] = emitted[keep]
        accepted.append(a[start == 0].double().mean().item())  # whole first windows
        start = start + a + 1
    assert (out[:, :rounds] >= 0).all()
    return out, accepted[0]


@pytest.fixture(scope="module")
def toy():
    return _toy_tables()


def test_block_rounds_follow_the_target(toy):
    P, Q = toy
    out, block_mean = _simulate(accept_block, P, Q, by_window=True)
    assert _worst_pvalue(out, P) > 1e-3
    _, token_mean = _simulate(accept_rejection, P, Q, by_window=False, rounds=1)
    assert block_mean > token_mean + 0.01, (block_mean, token_mean)


def test_block_rounds_need_window_keyed_uniforms(toy):
    P, Q = toy
    out, _ = _simulate(accept_block, P, Q, by_window=False)
    worst = min(_chi2_pvalue(out[:, i], P[i]) for i in range(1, N_EMIT))
    assert worst < 1e-6
