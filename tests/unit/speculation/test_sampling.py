"""Counter-based RNG, logit warping, sampling and the two speculative acceptance rules.

Statistical tests use fixed seeds, so they are deterministic; each has a negative control
showing that the same check rejects a wrong rule.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runtime.speculation.acceptance import (
    accept_rejection,
    accept_tokens,
    count_accepted,
    gather_token_probs,
    rejection_test,
    residual_probs,
    sample_correction,
)
from runtime.speculation.rng import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TARGET,
    threefry2x32,
    uniform,
)
from runtime.speculation.sampling import sample_from, warp_probs

pytestmark = pytest.mark.timeout(120)

M = 0xFFFFFFFF
TOP_U = 1.0 - 2.0**-24  # the largest float32 uniform() returns


def _t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of tokens ~ probs (flattened categorical); 0.0 if a zero-probability cell is hit."""
    probs = probs.flatten().double()
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    live = probs > 0
    if counts[~live].sum() > 0:
        return 0.0
    expected = probs[live] / probs[live].sum() * counts[live].sum()
    return float(stats.chisquare(counts[live].numpy(), expected.numpy()).pvalue)


# ---------------------------------------------------------------- rng


@pytest.mark.parametrize(
    "rounds,key,ctr,want",
    [
        (20, (0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        (20, (M, M), (M, M), (0x1CB996FC, 0xBB002BE7)),
        (20, (0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
        (13, (0, 0), (0, 0), (0x9D1C5EC6, 0x8BD50731)),
        (13, (M, M), (M, M), (0xFD36D048, 0x2D17272C)),
    ],
)
def test_threefry_known_answers(rounds, key, ctr, want):  # Random123 / JAX test vectors
    args = [torch.tensor([v], dtype=torch.int64) for v in (*key, *ctr)]
    x0, x1 = threefry2x32(*args, rounds=rounds)
    assert (x0.item(), x1.item()) == want


def test_uniform_layout_and_determinism():
    zero = torch.zeros(1, dtype=torch.int64)
    assert uniform(zero, zero[:, None], 0, torch.float32).item() == (0x6B200159 >> 8) * 2.0**-24
    word53 = (0x6B200159 << 21) | (0x99BA4EFE >> 11)
    assert uniform(zero, zero[:, None], 0).item() == word53 * 2.0**-53
    seed = torch.tensor([0, 1, 2**62 - 1, 12345])
    pos = torch.arange(40).view(4, 10) * 1000003
    u = uniform(seed, pos, STREAM_TARGET, torch.float32)
    assert u.shape == (4, 10) and u.dtype == torch.float32
    assert torch.equal(u, uniform(seed.clone(), pos.clone(), STREAM_TARGET, torch.float32))
    for b in range(4):  # batch composition does not matter
        assert torch.equal(u[b : b + 1], uniform(seed[b : b + 1], pos[b : b + 1], 2, torch.float32))
        part = uniform(seed[b : b + 1], pos[b : b + 1, 3:5], 2, torch.float32)
        assert torch.equal(u[b, 3:5], part[0])
    u64 = uniform(seed, pos, 2)
    assert u64.dtype == torch.float64 and ((u64 - u).abs() < 2.0**-24).all()
    with pytest.raises(ValueError):
        uniform(seed, pos, 2**16)


def test_uniform_is_uniform():
    seed = torch.arange(1000)
    pos = torch.arange(500).expand(1000, 500)
    u = uniform(seed, pos, STREAM_DRAFT, torch.float32).flatten()  # 5e5 draws
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert stats.kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    bins = torch.bincount((u * 1024).long(), minlength=1024)
    assert stats.chisquare(bins.numpy()).pvalue > 1e-3
    u64 = uniform(seed[:200], pos[:200], STREAM_DRAFT).flatten()
    assert stats.kstest(u64.numpy(), "uniform").pvalue > 1e-3
    top = 2**62 - 1 - seed  # huge seeds and positions
    u_top = uniform(top, pos + (2**40), STREAM_DRAFT, torch.float32).flatten()
    assert stats.kstest(u_top.double().numpy(), "uniform").pvalue > 1e-3


def _pair_pvalue(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    cell = (a * bins).long() * bins + (b * bins).long()
    return float(stats.chisquare(torch.bincount(cell.flatten(), minlength=bins * bins)).pvalue)


def test_uniform_independence():
    seed = torch.arange(1000)
    pos = torch.arange(201).expand(1000, 201)
    u0 = uniform(seed, pos, 0)
    assert _pair_pvalue(u0, uniform(seed, pos, 1)) > 1e-3  # across streams
    assert _pair_pvalue(uniform(seed, pos, 1), uniform(seed, pos, 2)) > 1e-3
    assert _pair_pvalue(u0[:, :-1], u0[:, 1:]) > 1e-3  # across positions
    assert _pair_pvalue(u0[:-1], u0[1:]) > 1e-3  # across seeds
    assert _pair_pvalue(u0[:-1, :-1], u0[1:, 1:]) > 1e-3
    r = torch.corrcoef(torch.stack([u0[:-1, :-1].flatten(), u0[1:, 1:].flatten()]))[0, 1]
    assert abs(r.item()) < 5 / u0[1:, 1:].numel() ** 0.5  # 5 sigma
    assert _pair_pvalue(u0, u0) < 1e-6  # negative control


# ---------------------------------------------------------------- warp_probs


def _hf_probs(logits_row: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    if t == 0:
        return torch.nn.functional.one_hot(logits_row.argmax(-1), logits_row.shape[-1]).float()
    s = logits_row.float()
    if t != 1.0:
        s = TemperatureLogitsWarper(t)(None, s)
    if k != 0:
        s = TopKLogitsWarper(k)(None, s)
    if p < 1.0:
        s = TopPLogitsWarper(p)(None, s)
    return s.softmax(-1)


def test_warp_probs_matches_transformers():
    g = torch.Generator().manual_seed(0)
    B, n, V = 400, 3, 64
    logits = torch.randn(B, n, V, generator=g) * 3
    tied = torch.arange(B) % 4 == 0
    logits[tied] = (logits[tied] * 2).round() / 2  # many equal logits

    def pick(vals):
        return vals[torch.randint(0, len(vals), (B,), generator=g)]

    temperature = pick(_t(0.0, 0.3, 0.7, 1.0, 1.3, 2.0))
    top_k = pick(_t(0, 1, 2, 5, 20, 100, dtype=torch.int64))
    top_p = pick(_t(1.0, 0.95, 0.9, 0.5, 0.1, 0.0))
    out = warp_probs(logits, temperature, top_k, top_p)
    assert out.shape == (B, n, V) and out.dtype == torch.float32
    for b in range(B):
        ref = _hf_probs(logits[b], temperature[b].item(), int(top_k[b]), top_p[b].item())
        if not tied[b]:
            assert torch.equal(out[b], ref), b
        else:  # which of several tied tokens top-p keeps is up to transformers' unstable sort
            torch.testing.assert_close(out[b].sort(-1).values, ref.sort(-1).values)


def test_warp_probs_greedy_ties_and_dtypes():
    logits = _t(1.0, 3.0, 3.0, -2.0, 3.0, 0.0).view(1, 1, 6).expand(3, 2, 6).contiguous()
    temperature, top_k = _t(0.0, 1.0, 0.5), torch.tensor([0, 0, 2])
    out = warp_probs(logits.bfloat16(), temperature, top_k, _t(1.0, 0.0, 1.0))
    assert out.dtype == torch.float32
    assert torch.equal(out[0], torch.eye(6)[[1, 1]])  # greedy: first argmax
    assert torch.equal(out[1], torch.eye(6)[[1, 1]])  # top_p=0 keeps first max
    assert torch.equal(out[2, 0] > 0, torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool))
    torch.testing.assert_close(out[2, 0, 1], torch.tensor(1 / 3))  # top-k keeps all ties
    halves = warp_probs(_t(0.0, 0.0, 0.0, 0.0).view(1, 1, 4), _t(1.0), torch.tensor([0]), _t(0.5))
    assert torch.equal(halves[0, 0], _t(0.5, 0.5, 0.0, 0.0))  # cum <= 1 - p removed


# ---------------------------------------------------------------- sample_from


def test_sample_from_edges():
    probs = _t(0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0).expand(6, 7)
    u = _t(0.0, 0.2499, 0.25, 0.7499, 0.75, TOP_U)
    assert sample_from(probs, u).tolist() == [1, 1, 3, 3, 4, 4]
    short = torch.full((2, 7), 0.1)  # total < 1, zero tail
    short[:, 5:] = 0.0
    short[1, 4] = 1e-30  # would vanish in a float32 cumsum
    assert sample_from(short, _t(TOP_U, TOP_U)).tolist() == [4, 3]
    assert sample_from(short, _t(TOP_U, 1 - 2.0**-53, dtype=torch.float64)).tolist() == [4, 4]
    one_hot = torch.eye(5)[[0, 2, 4]]
    for x in (0.0, 0.5, TOP_U):
        assert sample_from(one_hot, _t(x, x, x)).tolist() == [0, 2, 4]
    weights = _t(2.0, 0.0, 6.0).expand(2, 3)  # unnormalised is fine
    assert sample_from(weights, _t(0.2499, 0.25)).tolist() == [0, 2]
    assert sample_from(torch.zeros(1, 3), _t(0.5)).tolist() == [0]  # all zero: 0
    tiny = torch.tensor([[0.5, 2.0**-30, 0.5 - 2.0**-30]], dtype=torch.float64)
    u_fine = torch.tensor([0.5 + 2.0**-31, 0.5 + 2.0**-30], dtype=torch.float64)
    assert sample_from(tiny.expand(2, 3), u_fine).tolist() == [1, 2]  # resolves 2**-30
    assert sample_from(probs.double(), u.double()).tolist() == [1, 1, 3, 3, 4, 4]


def test_sample_from_distribution():
    p = torch.softmax(torch.randn(16, generator=torch.Generator().manual_seed(1)), -1)
    p[3] = 0.0
    u = uniform(torch.arange(100_000), torch.zeros(100_000, 1, dtype=torch.int64), 0)
    tokens = sample_from(p.expand(100_000, 1, 16), u)
    assert _chi2_pvalue(tokens, p) > 1e-3
    assert _chi2_pvalue(tokens, torch.roll(p, 1)) < 1e-6  # negative control


# ---------------------------------------------------------------- acceptance: unit tests


def test_rejection_test_rule():
    p = _t(0.2, 0.2, 0.2, 0.3, 0.0, 0.7)
    q = _t(0.4, 0.4, 0.4, 0.3, 0.5, 0.0)  # ratio 0.5 (x3), p == q, p = 0, q = 0
    u = _t(0.49, 0.5, 0.51, TOP_U, 0.0, TOP_U)
    assert rejection_test(p, q, u).tolist() == [True, False, False, True, False, True]
    ratio = torch.rand(1000, generator=torch.Generator().manual_seed(2))
    assert rejection_test(ratio, ratio, torch.full((1000,), TOP_U)).all()  # p == q


def test_residual_probs_exact():
    p = _t(0.5, 0.25, 0.25, 0.0)
    q = _t(0.25, 0.25, 0.0, 0.5)
    assert torch.equal(residual_probs(p, q), _t(0.5, 0.0, 0.5, 0.0))
    assert torch.equal(residual_probs(p, p), p)  # p == q: sample from p
    assert torch.equal(residual_probs(_t(0.0, 1.0, 0.0), _t(0.5, 0.0, 0.5)), _t(0.0, 1.0, 0.0))


def test_accept_rejection_hand_made():
    p = torch.tensor([[[0.5, 0.25, 0.25, 0.0], [0.0, 1.0, 0.0, 0.0], [0.25] * 4]])  # [1, 3, V]
    q = torch.tensor([[[0.0, 0.5, 0.0, 0.5], [0.0, 1.0, 0.0, 0.0]]])  # [1, 2, V]
    u_s = _t(0.0, 0.0, 0.6).view(1, 3)
    # d0=0: q(d0)=0 -> accept; d1=1: p == q -> accept; bonus from p_2 at u=0.6 -> token 2
    a, nxt = accept_rejection(torch.tensor([[0, 1]]), q, p, _t(TOP_U, TOP_U).view(1, 2), u_s)
    assert (a.item(), nxt.item()) == (2, 2)
    # d0=3: p(d0)=0 -> reject; residual max(0, p0 - q0) / 0.75 = [2/3, 0, 1/3, 0]
    for u0, want in ((0.0, 0), (0.66, 0), (0.67, 2), (TOP_U, 2)):
        u_s = _t(u0, 0.0, 0.0).view(1, 3)
        a, nxt = accept_rejection(torch.tensor([[3, 1]]), q, p, _t(0.0, 0.0).view(1, 2), u_s)
        assert (a.item(), nxt.item()) == (0, want)
    # d0=1: p/q = 0.5 -> accepted iff u < 0.5; then d1=2 with q(d1)=0 is accepted
    a, _ = accept_rejection(torch.tensor([[1, 2]]), q, p, _t(0.4999, 0.9).view(1, 2), u_s)
    assert a.item() == 2
    a, nxt = accept_rejection(torch.tensor([[1, 2]]), q, p, _t(0.5, 0.9).view(1, 2), u_s)
    assert (a.item(), nxt.item()) == (0, 2)  # u_s[0] = TOP_U


def test_masked_target_token_always_rejected():
    g = torch.Generator().manual_seed(3)
    B, k, V = 64, 2, 32
    target_logits = torch.randn(B, k + 1, V, generator=g)
    # top-k = 1 for half the rows, top-p = 0.05 for the other half: the draft's token is masked
    top_k = torch.where(torch.arange(B) % 2 == 0, 1, 0)
    top_p = torch.where(torch.arange(B) % 2 == 0, 1.0, 0.05)
    p = warp_probs(target_logits, torch.ones(B), top_k, top_p)
    d = (target_logits.argmax(-1)[:, :k] + 1 + torch.arange(B)[:, None] % (V - 1)) % V
    assert (gather_token_probs(p[:, :k], d) == 0).all()
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    for u in (0.0, 0.5, TOP_U):
        a, nxt = accept_rejection(d, q, p, torch.full((B, k), u), torch.full((B, k + 1), u))
        assert (a == 0).all() and (nxt != d[:, 0]).all()
        assert (gather_token_probs(p[:, :1], nxt[:, None]) > 0).all()
        a, nxt = accept_tokens(d, p, torch.full((B, k + 1), u))
        assert (a == 0).all() and (nxt != d[:, 0]).all()


def test_greedy_reduction():
    g = torch.Generator().manual_seed(4)
    B, k, V = 256, 4, 50
    target_logits = torch.randn(B, k + 1, V, generator=g).bfloat16()
    choice = target_logits.argmax(-1)  # [B, k+1]
    wrong = torch.rand(B, k, generator=g) < 0.25
    d = torch.where(wrong, (choice[:, :k] + 7) % V, choice[:, :k])  # [B, k]
    draft_logits = torch.randn(B, k, V, generator=g).scatter(-1, d[..., None], 10.0)
    zeros = torch.zeros(B)
    p = warp_probs(target_logits, zeros, torch.full((B,), 5), torch.full((B,), 0.5))
    q = warp_probs(draft_logits, zeros, torch.zeros(B, dtype=torch.int64), torch.ones(B))
    want_a = count_accepted(d == choice[:, :k])
    want_next = choice.gather(1, want_a[:, None]).squeeze(1)
    for u in (0.0, 0.3, TOP_U):
        assert torch.equal(sample_from(q, torch.full((B, k), u)), d)
        a, nxt = accept_rejection(d, q, p, torch.full((B, k), u), torch.full((B, k + 1), u))
        assert torch.equal(a, want_a) and torch.equal(nxt, want_next)
        a, nxt = accept_tokens(d, p, torch.full((B, k + 1), u))
        assert torch.equal(a, want_a) and torch.equal(nxt, want_next)
    assert 0 < (want_a == k).sum() < B and (want_a == 0).sum() > 0


def test_no_draft_tokens():
    p = torch.eye(3)[[2]].view(1, 1, 3)
    d = torch.zeros(1, 0, dtype=torch.int64)
    a, nxt = accept_rejection(d, torch.zeros(1, 0, 3), p, torch.zeros(1, 0), _t(0.5).view(1, 1))
    assert (a.item(), nxt.item()) == (0, 2)
    assert accept_tokens(d, p, _t(0.5).view(1, 1))[1].item() == 2


# ---------------------------------------------------------------- acceptance: statistics

N_ROWS, K, V_TOY, N_EMIT = 200_000, 3, 8, 4


def _toy_tables():
    """P[pos], Q[pos]: [N_EMIT + K, V] target and draft distributions per absolute position,
    independent of the prefix, so target sampling emits independent tokens x_pos ~ P[pos]."""
    g = torch.Generator().manual_seed(5)
    L = N_EMIT + K
    gamma2 = -torch.rand(L, V_TOY, 2, generator=g).log().sum(-1)  # Dirichlet(2) after norm
    P = 0.7 * gamma2 / gamma2.sum(-1, keepdim=True) + 0.3 / V_TOY
    Q = torch.softmax(2 * torch.randn(L, V_TOY, generator=g), -1)
    P[torch.arange(L), (3 * torch.arange(L)) % V_TOY] = 0.0  # like a top-k/top-p mask
    Q[torch.arange(L), (5 * torch.arange(L) + 1) % V_TOY] = 0.0  # q = 0 where p > 0
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


def _simulate(rule, P, Q, U, rounds=N_EMIT):
    """Speculative decoding rounds (>= 1 token each); the uniforms of the row with seed s at
    position t are U[stream][s, t] = uniform(s, t, stream), looked up by absolute position."""
    out = torch.full((N_ROWS, N_EMIT), -1)
    start = torch.zeros(N_ROWS, dtype=torch.int64)
    steps = torch.arange(K + 1)
    rows = torch.arange(N_ROWS)[:, None].expand(N_ROWS, K + 1)
    for _ in range(rounds):
        pos = (start[:, None] + steps).clamp(max=len(P) - 1)  # [N, K+1]; clamp: done rows
        p, q = P[pos], Q[pos[:, :K]]  # [N, K+1, V], [N, K, V]
        d = sample_from(q, U[STREAM_DRAFT].gather(1, pos[:, :K]))  # [N, K]
        a, nxt = rule(
            d, q, p, U[STREAM_ACCEPT].gather(1, pos[:, :K]), U[STREAM_TARGET].gather(1, pos)
        )
        emitted = torch.cat([d, d[:, :1]], 1).scatter(1, a[:, None], nxt[:, None])
        keep = (steps <= a[:, None]) & (start[:, None] + steps < N_EMIT)
        out[rows[keep], pos[keep]] = emitted[keep]
        start = start + a + 1
    assert (out[:, :rounds] >= 0).all()
    return out


def _worst_pvalue(out, P):
    checks = [_chi2_pvalue(out[:, i], P[i]) for i in range(N_EMIT)]
    checks.append(_chi2_pvalue(out[:, 0] * V_TOY + out[:, 1], torch.outer(P[0], P[1])))
    checks.append(_chi2_pvalue(out[:, 2] * V_TOY + out[:, 3], torch.outer(P[2], P[3])))
    return min(checks)


def _tokens_rule(d, q, p, u_accept, u_sample):
    return accept_tokens(d, p, u_sample)


def _ignore_q_rule(d, q, p, u_accept, u_sample):  # wrong: accept with probability p(d)
    a = count_accepted(u_accept < gather_token_probs(p[:, :K], d))
    return a, sample_correction(q, p, a, u_sample)


def _always_accept_rule(d, q, p, u_accept, u_sample):  # wrong: leaks q
    a = torch.full_like(d[:, 0], K)
    return a, sample_correction(q, p, a, u_sample)


def _resample_p_rule(d, q, p, u_accept, u_sample):  # wrong: correction from p, not residual
    a = count_accepted(
        rejection_test(gather_token_probs(p[:, :K], d), gather_token_probs(q, d), u_accept)
    )
    p_a = p.gather(1, a.view(-1, 1, 1).expand(-1, 1, V_TOY)).squeeze(1)
    return a, sample_from(p_a, u_sample.gather(1, a[:, None]).squeeze(1))


@pytest.fixture(scope="module")
def toy():
    P, Q = _toy_tables()
    seeds = torch.arange(N_ROWS)
    pos = torch.arange(len(P)).expand(N_ROWS, len(P))
    U = {s: uniform(seeds, pos, s) for s in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET)}
    return P, Q, U


@pytest.fixture(scope="module")
def simulate(toy):
    cache = {}

    def run(rule, rounds=N_EMIT):
        if (rule, rounds) not in cache:
            cache[rule, rounds] = _simulate(rule, *toy, rounds=rounds)
        return cache[rule, rounds]

    return run


@pytest.mark.parametrize("rule", [accept_rejection, _tokens_rule])
def test_emitted_tokens_follow_target(toy, simulate, rule):
    assert _worst_pvalue(simulate(rule), toy[0]) > 1e-3


def test_accept_tokens_equals_target_alone(toy, simulate):
    P, Q, U = toy
    alone = sample_from(P[:N_EMIT].expand(N_ROWS, -1, -1), U[STREAM_TARGET][:, :N_EMIT])
    assert torch.equal(simulate(_tokens_rule), alone)
    # whatever the draft proposes: even drafting with the target's own uniforms (coupled draws)
    coupled = {**U, STREAM_DRAFT: U[STREAM_TARGET]}
    assert torch.equal(_simulate(_tokens_rule, P, Q, coupled), alone)


def test_rejection_needs_separate_draft_stream(toy):
    """Drafting with STREAM_TARGET correlates the rejected draft token with the correction."""
    P, Q, U = toy
    coupled = {**U, STREAM_DRAFT: U[STREAM_TARGET]}
    out = _simulate(accept_rejection, P, Q, coupled, rounds=1)
    assert _chi2_pvalue(out[:, 0], P[0]) < 1e-6


@pytest.mark.parametrize("rule", [_ignore_q_rule, _always_accept_rule, _resample_p_rule])
def test_negative_controls_fail(toy, simulate, rule):
    out = simulate(rule, rounds=1)
    assert _chi2_pvalue(out[:, 0], toy[0][0]) < 1e-6


def test_unfiltered_fast_path_matches():
    torch.manual_seed(3)
    logits = torch.randn(4, 3, 50)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7])
    off_k, off_p = torch.zeros(4, dtype=torch.long), torch.ones(4)
    assert torch.equal(
        warp_probs(logits, temperature, off_k, off_p),
        warp_probs(logits, temperature, off_k, off_p, filtered=False),
    )
