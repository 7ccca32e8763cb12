"""The acceptance rules on hand-made p and q: greedy matching, and block verification (Sun et
al. 2025, runtime.speculation.acceptance.accept_block): its weights, keep probabilities,
accepted lengths and residuals against a reference written from the paper's Algorithm 2 in
plain Python, whose exact output distribution (enumerated over every draft block of a 3-token
vocabulary) is the target's."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.speculation.acceptance import (
    accept_block,
    accept_rejection,
    block_keep_probs,
    block_weights,
    gather_token_probs,
    greedy_accept,
)
from runtime.speculation.sampling import sample_from, warp_probs

pytestmark = pytest.mark.timeout(120)


def one_hot_logits(choices, vocab=10):
    """[B, k+1, V] logits whose argmax at each position is choices[b][i]."""
    logits = torch.zeros(len(choices), len(choices[0]), vocab)
    for b, row in enumerate(choices):
        for i, tok in enumerate(row):
            logits[b, i, tok] = 5.0
    return logits


def test_greedy_accept_ragged():
    draft = torch.tensor([[3, 4, 5], [3, 4, 5], [7, 4, 5], [3, 9, 5]])
    target = one_hot_logits([[3, 4, 5, 6], [3, 4, 1, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    accepted, nxt = greedy_accept(draft, target)
    assert accepted.tolist() == [3, 2, 0, 1]
    assert nxt.tolist() == [6, 1, 3, 4]


def test_greedy_accept_later_match_does_not_count():
    draft = torch.tensor([[1, 2, 3]])
    target = one_hot_logits([[0, 2, 3, 4]])
    accepted, nxt = greedy_accept(draft, target)
    assert accepted.tolist() == [0] and nxt.tolist() == [0]


V, K = 3, 3
Prefix = tuple[int, ...]


def _tables(seed: int) -> tuple[dict[Prefix, list[float]], dict[Prefix, list[float]]]:
    """Target p(. | prefix) and draft q(. | prefix) for every prefix of length <= K over V
    tokens: context-dependent, with zeros (a token the target forbids, like a top-k or
    grammar mask; a token the draft never proposes where the target may)."""
    g = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for n in range(K + 1):
        for prefix in itertools.product(range(V), repeat=n):
            pp = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
            qq = torch.rand(V, generator=g, dtype=torch.float64) ** 2 + 0.02
            pp[(sum(prefix) + n) % V] *= float(n % 2)  # p = 0 on every other position
            qq[(2 * sum(prefix) + 1) % V] *= float(n % 3 != 1)  # some q = 0
            p[prefix] = (pp / pp.sum()).tolist()
            q[prefix] = (qq / qq.sum()).tolist()
    return p, q


# ---------------------------------------------------------------- the reference (Algorithm 2)


def _ref_weights(p, q, x: Prefix) -> list[float]:
    """w_0 = 1, w_i = min(1, w_{i-1} p(x_i | x_<i) / q(x_i | x_<i))."""
    w = [1.0]
    for i, tok in enumerate(x):
        a, b = p[x[:i]][tok], q[x[:i]][tok]
        w.append(min(1.0, w[-1] * a / b) if b > 0 else float(w[-1] > 0 and a > 0))
    return w


def _ref_keep(p, q, x: Prefix) -> list[float]:
    """h_1..h_k: s_i / (s_i + 1 - w_i) with s_i = sum_x max(0, w_i p_i - q_i); h_k = w_k."""
    w, k = _ref_weights(p, q, x), len(x)
    h = []
    for i in range(1, k):
        s = sum(max(0.0, w[i] * a - b) for a, b in zip(p[x[:i]], q[x[:i]]))
        h.append(s / (s + 1.0 - w[i]) if s > 0 else 0.0)
    return h + [w[k]]


def _ref_residual(p, q, x: Prefix, tau: int) -> list[float]:
    """The next token's distribution after tau accepted: p_k (bonus) or the residual."""
    if tau == len(x):
        return p[x]
    w = _ref_weights(p, q, x)[tau]
    r = [max(0.0, w * a - b) for a, b in zip(p[x[:tau]], q[x[:tau]])]
    return [v / sum(r) for v in r]


def _ref_tau_probs(h: list[float]) -> list[float]:
    """P(tau = i), i = 0..k: tau is the largest i with eta_i < h_i."""
    k = len(h)
    later = [math.prod(1.0 - v for v in h[i:]) for i in range(k + 1)]  # no j > i kept
    return [later[0]] + [h[i - 1] * later[i] for i in range(1, k + 1)]


def _prob(table, x: Prefix) -> float:
    return math.prod(table[x[:i]][tok] for i, tok in enumerate(x))


def _emitted_then_target(p, q, tau_probs) -> dict[Prefix, float]:
    """Exact distribution of K + 1 tokens: one round's emission (drafts X ~ q, tau with
    tau_probs(X), the next token), continued by the target alone."""
    out: dict[Prefix, float] = {}
    for x in itertools.product(range(V), repeat=K):
        px = _prob(q, x)
        if px == 0:
            continue  # a block the draft never proposes
        for tau, pt in enumerate(tau_probs(x)):
            if pt == 0:
                continue
            for y, py in enumerate(_ref_residual(p, q, x, tau)):
                head = x[:tau] + (y,)
                for tail in itertools.product(range(V), repeat=K - tau):
                    seq = head + tail
                    rest = math.prod(p[seq[:j]][seq[j]] for j in range(len(head), K + 1))
                    out[seq] = out.get(seq, 0.0) + px * pt * py * rest
    return out


def _block_tau(p, q):
    return lambda x: _ref_tau_probs(_ref_keep(p, q, x))


def _token_tau(p, q):
    """The token rule: accept x_i with probability min(1, p/q) until the first rejection."""

    def probs(x):
        a = [min(1.0, p[x[:i]][t] / max(q[x[:i]][t], 1e-300)) for i, t in enumerate(x)]
        return [math.prod(a[:i]) * (1 - a[i] if i < K else 1) for i in range(K + 1)]

    return probs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_emits_the_target_and_never_fewer_tokens(seed):
    p, q = _tables(seed)
    emitted = _emitted_then_target(p, q, _block_tau(p, q))
    for seq in itertools.product(range(V), repeat=K + 1):
        assert emitted.get(seq, 0.0) == pytest.approx(_prob(p, seq), abs=1e-12), seq
    # control: accepting every draft (no test) emits the draft's distribution instead
    wrong = _emitted_then_target(p, q, lambda x: [0.0] * K + [1.0])
    assert max(abs(wrong.get(s, 0) - _prob(p, s)) for s in wrong) > 0.01
    # Theorem 2: the expected accepted length is at least the token rule's
    blocks = list(itertools.product(range(V), repeat=K))
    block = sum(_prob(q, x) * _mean(_block_tau(p, q)(x)) for x in blocks)
    token = sum(_prob(q, x) * _mean(_token_tau(p, q)(x)) for x in blocks)
    assert block >= token - 1e-12 and block > token + 1e-3, (block, token)


def _mean(tau_probs: list[float]) -> float:
    return sum(i * v for i, v in enumerate(tau_probs))


# ---------------------------------------------------------------- the implementation


def _batch(p, q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every draft block x of the tables as a batch: tokens [N, K], q [N, K, V], p [N, K+1, V]."""
    blocks = list(itertools.product(range(V), repeat=K))
    tokens = torch.tensor(blocks)
    qs = torch.tensor([[q[x[:i]] for i in range(K)] for x in blocks], dtype=torch.float32)
    ps = torch.tensor([[p[x[:i]] for i in range(K + 1)] for x in blocks], dtype=torch.float32)
    return tokens, qs, ps


@pytest.mark.parametrize("seed", [0, 1])
def test_weights_and_keep_probs_follow_the_reference(seed):
    p, q = _tables(seed)
    tokens, qs, ps = _batch(p, q)
    w = block_weights(gather_token_probs(ps[:, :K], tokens), gather_token_probs(qs, tokens))
    h = block_keep_probs(w, qs, ps)
    for row, x in enumerate(tokens.tolist()):
        assert w[row].tolist() == pytest.approx(_ref_weights(p, q, tuple(x)), abs=1e-6)
        assert h[row].tolist() == pytest.approx(_ref_keep(p, q, tuple(x)), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_accepted_length_and_next_token_follow_the_reference(seed):
    """For every block and eta patterns on both sides of each h_i: tau is the largest i with
    eta_i < h_i, and the next token is the reference residual's inverse-CDF choice."""
    p, q = _tables(seed)
    tokens, qs, ps = _batch(p, q)
    n = len(tokens)
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        eta = torch.rand(n, K, generator=g, dtype=torch.float64)
        u = torch.rand(n, K + 1, generator=g, dtype=torch.float64)
        accepted, nxt = accept_block(tokens, qs, ps, eta, u)
        for row, x in enumerate(map(tuple, tokens.tolist())):
            h = _ref_keep(p, q, x)
            if min(abs(e - v) for e, v in zip(eta[row].tolist(), h)) < 1e-5:
                continue  # too close to a threshold for float32
            want = max([i + 1 for i in range(K) if eta[row, i] < h[i]], default=0)
            assert accepted[row].item() == want, (x, eta[row], h)
            cdf = itertools.accumulate(_ref_residual(p, q, x, want))
            uu = u[row, want].item()
            if min(abs(c - uu) for c in cdf) > 1e-5:
                want_next = sum(c <= uu for c in itertools.accumulate(_ref_residual(p, q, x, want)))
                assert nxt[row].item() == want_next, (x, want, uu)


def test_paper_example_two_tokens():
    """Sun et al.'s example: p = (1/3, 2/3), q = (2/3, 1/3) at every position, k = 2: the
    block rule accepts 11/9 tokens a round in expectation, the token rule 10/9."""
    p1, q1 = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    blocks = torch.tensor(list(itertools.product(range(2), repeat=2)))  # aa, ab, ba, bb
    ps, qs = p1.expand(4, 3, 2), q1.expand(4, 2, 2)
    w = block_weights(gather_token_probs(ps[:, :2], blocks), gather_token_probs(qs, blocks))
    want_w = [[1, 0.5, 0.25], [1, 0.5, 1], [1, 1, 0.5], [1, 1, 1]]
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float32))
    h = block_keep_probs(w, qs, ps)
    torch.testing.assert_close(h, torch.tensor([[0, 0.25], [0, 1], [1, 0.5], [1, 1.0]]))
    prob_x = q1[blocks].prod(-1)  # [4]
    mean = sum(prob_x[r] * _mean(_ref_tau_probs(h[r].tolist())) for r in range(4))
    assert mean.item() == pytest.approx(11 / 9)
    # eta below h_2 keeps the whole window; above it, "ba" keeps 1 and "aa" none
    eta = torch.tensor([[0.0, 0.2], [0.0, 0.2], [0.9, 0.6], [0.9, 0.6]], dtype=torch.float64)
    u = torch.full((4, 3), 0.5, dtype=torch.float64)
    rows = torch.tensor([0, 1, 2, 0])
    a, nxt = accept_block(blocks[rows], qs, ps, eta, u)
    assert a.tolist() == [2, 2, 1, 0]
    # "ba" kept 1 with w_1 = 1: residual max(0, p - q) = b; "aa" kept none: b too
    assert nxt.tolist() == [1, 1, 1, 1]


def test_weighted_residual_after_a_partly_accepted_block():
    """tau = 1 with w_1 = 1/2: the next token is drawn from max(0, p_1 / 2 - q_1), not from
    max(0, p_1 - q_1) (the token rule's)."""
    tokens = torch.tensor([[0, 2]])
    qs = torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]]])
    ps = torch.tensor([[[0.25, 0.75, 0.0], [0.8, 0.2, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    w = block_weights(gather_token_probs(ps[:, :2], tokens), gather_token_probs(qs, tokens))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 0.0]]))  # p_1(2) = 0: w_2 = 0
    h = block_keep_probs(w, qs, ps)  # s_1 = 0.4 - 0.1 = 0.3, h_1 = 0.3 / 0.8
    torch.testing.assert_close(h, torch.tensor([[0.375, 0.0]]))
    for u1 in (0.0, 0.5, 0.99):  # the residual is (1, 0, 0): token 0 whatever u
        u = torch.tensor([[0.0, u1, 0.0]], dtype=torch.float64)
        a, nxt = accept_block(tokens, qs, ps, torch.tensor([[0.374, 0.0]]).double(), u)
        assert (a.item(), nxt.item()) == (1, 0)
    a, _ = accept_block(tokens, qs, ps, torch.tensor([[0.376, 0.0]]).double(), u)
    assert a.item() == 0
    # the token rule keeps d_1 (0.374 < p/q = 0.5), rejects d_2 (p = 0) and samples
    # max(0, p_1 - q_1) = (7/8, 1/8, 0): token 1 at u = 0.99
    a, nxt = accept_rejection(tokens, qs, ps, torch.tensor([[0.374, 0.9]]).double(), u)
    assert (a.item(), nxt.item()) == (1, 1)


def test_greedy_rows_match_the_argmax():
    """One-hot p and q (greedy rows in a sampled batch): the block rule is greedy matching."""
    g = torch.Generator().manual_seed(4)
    B, k, Vg = 256, 4, 50
    target_logits = torch.randn(B, k + 1, Vg, generator=g)
    choice = target_logits.argmax(-1)  # [B, k+1]
    wrong = torch.rand(B, k, generator=g) < 0.25
    d = torch.where(wrong, (choice[:, :k] + 7) % Vg, choice[:, :k])
    draft_logits = torch.randn(B, k, Vg, generator=g).scatter(-1, d[..., None], 10.0)
    zeros, off_k, off_p = torch.zeros(B), torch.zeros(B, dtype=torch.int64), torch.ones(B)
    p = warp_probs(target_logits, zeros, off_k, off_p)
    q = warp_probs(draft_logits, zeros, off_k, off_p)
    want_a = (d == choice[:, :k]).long().cumprod(-1).sum(-1)
    for u in (0.0, 0.3, 1 - 2.0**-24):
        a, nxt = accept_block(d, q, p, torch.full((B, k), u), torch.full((B, k + 1), u))
        assert torch.equal(a, want_a)
        assert torch.equal(nxt, choice.gather(1, want_a[:, None]).squeeze(1))


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(6)
    B, k, Vb = 12, 5, 40
    p = torch.softmax(torch.randn(B, k + 1, Vb, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, Vb, generator=g), -1)
    d = sample_from(q, torch.rand(B, k, generator=g, dtype=torch.float64))
    eta = torch.rand(B, k, generator=g, dtype=torch.float64)
    u = torch.rand(B, k + 1, generator=g, dtype=torch.float64)
    a, nxt = accept_block(d, q, p, eta, u)
    assert 0 < a.sum() < B * k
    for i in range(B):
        one = accept_block(d[i : i + 1], q[i : i + 1], p[i : i + 1], eta[i : i + 1], u[i : i + 1])
        assert (one[0].item(), one[1].item()) == (a[i].item(), nxt[i].item())


def test_no_draft_tokens_sample_the_target():
    p = torch.eye(3)[[2]].view(1, 1, 3)
    d = torch.zeros(1, 0, dtype=torch.int64)
    u = torch.tensor([[0.5]], dtype=torch.float64)
    assert accept_block(d, torch.zeros(1, 0, 3), p, torch.zeros(1, 0), u)[1].item() == 2
