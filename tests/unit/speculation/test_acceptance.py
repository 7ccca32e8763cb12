import pytest
import torch

from runtime.speculation.acceptance import greedy_accept

pytestmark = pytest.mark.timeout(30)


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
