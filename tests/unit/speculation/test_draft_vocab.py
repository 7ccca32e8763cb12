"""A draft padded differently from the target (runtime.speculation.vocab.DraftVocab): it
proposes only ids below the shared tokenizer's size even when its padding rows carry the
largest logits, its q is widened to the target's vocabulary, and `acceptance: logits` then
still reproduces the target's distribution."""

from __future__ import annotations

import pytest
import torch

from runtime.speculation.choose import BatchSampling, draft_choose, target_verify
from runtime.speculation.vocab import DraftVocab

VOCAB = DraftVocab(propose=5, width=7, embed=9)  # tokenizer 5; target 7 rows; draft 9


def batch(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> BatchSampling:
    return BatchSampling(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p),
        seed=torch.arange(n),
        greedy=temperature == 0,
        filtered=top_k > 0 or top_p < 1.0,
    )


def padded_logits(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 9] draft logits whose padding rows (ids 5..8) are the largest."""
    logits = torch.randn(n, VOCAB.embed, generator=gen)
    logits[:, VOCAB.propose :] += 10.0
    return logits


def test_greedy_never_proposes_padding():
    gen = torch.Generator().manual_seed(0)
    logits = padded_logits(64, gen)
    token, q = draft_choose(
        logits, batch(64, 0.0), torch.zeros(64, dtype=torch.long), "tokens", VOCAB
    )
    assert q is None
    assert torch.equal(token, logits[:, : VOCAB.propose].argmax(-1))
    unrestricted, _ = draft_choose(
        logits, batch(64, 0.0), torch.zeros(64, dtype=torch.long), "tokens"
    )
    assert (unrestricted >= VOCAB.propose).all()  # what the restriction prevents


@pytest.mark.parametrize("acceptance", ["tokens", "logits"])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_sampled_never_proposes_padding(acceptance, top_k, top_p):
    n = 4096
    logits = padded_logits(n, torch.Generator().manual_seed(1))
    index = torch.arange(n) % 17
    token, q = draft_choose(logits, batch(n, 1.3, top_k, top_p), index, acceptance, VOCAB)
    assert token.max() < VOCAB.propose and len(token.unique()) == VOCAB.propose
    assert q.shape == (n, VOCAB.width)
    assert (q[:, VOCAB.propose :] == 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(n))
    assert (q.gather(1, token[:, None]) > 0).all()  # q is what the token was drawn from


def test_inputs_clamped_into_the_draft_embedding():
    narrow = DraftVocab(propose=5, width=9, embed=7)  # the target's embedding is larger
    ids = torch.tensor([[0, 6, 7, 8]])
    assert narrow.inputs(ids).tolist() == [[0, 6, 6, 6]]
    assert VOCAB.inputs(ids) is ids  # the draft's embedding holds them all
    with pytest.raises(ValueError):
        DraftVocab(propose=8, width=7, embed=9)


def test_logits_acceptance_reproduces_the_target():
    """Rows of one draft/target pair, each with its own seed: the first emitted token is
    distributed as the target's softmax, mass on the target's padding ids (5, 6) included,
    which the draft never proposes."""
    n = 200_000
    gen = torch.Generator().manual_seed(2)
    draft = padded_logits(1, gen).expand(n, -1)
    target = torch.tensor([0.5, -1.0, 1.5, 0.0, 0.2, 0.9, -0.3])  # [7]
    target_logits = torch.stack([target, target]).expand(n, 2, -1)  # [n, k+1, 7]
    sampling, index = batch(n, 1.0), torch.zeros(n, dtype=torch.long)
    token, q = draft_choose(draft, sampling, index, "logits", VOCAB)
    accepted, nxt = target_verify(
        token[:, None], target_logits, sampling, index, "logits", q[:, None]
    )
    first = torch.where(accepted == 1, token, nxt)
    freq = torch.bincount(first, minlength=VOCAB.width).double() / n
    p = target.double().softmax(-1)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 5 * sigma + 1e-4).all(), (freq, p)
    assert 0.2 < accepted.double().mean() < 1.0
