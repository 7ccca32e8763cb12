"""DraftShard with a DraftVocab (a draft padded differently from the target): proposals stay
below the tokenizer's size whatever its logits favour, q is the target's width (drafted on
command, ahead, or as an overlapped window), and ids its embedding lacks are read clamped."""

from __future__ import annotations

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.models import load_model
from runtime.speculation.vocab import DraftVocab
from runtime.worker import overlap
from runtime.worker.draft_shard import DraftShard

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
SAMPLED = Sampling(1.5, 0, 1.0, 3)
GREEDY = Sampling(0.0, 0, 1.0, 0)
LIMIT = 40


def shard(path: str, params: dict, width: int) -> DraftShard:
    """The tiny Llama (vocab 96) as a draft: the tokenizer has LIMIT tokens, the target
    `width` rows; the draft's rows >= LIMIT are made to win every choice."""
    model = load_model(path, torch.float32, CPU)
    with torch.no_grad():  # rows >= LIMIT: 4 x rows below (the largest logit is positive)
        head = model.lm_head.weight
        head[LIMIT:] = 4 * head[: head.shape[0] - LIMIT]
    s = DraftShard(model, CPU, 2, 64, "logits", max_step_len=2)
    s.vocab = DraftVocab(LIMIT, width, model.vocab_size)
    # prompt ids the draft's embedding lacks (the target's padding) are read clamped
    s.prefill([0, 1], [[5, 6, width - 1, 7], [8, width - 2, 9]], [params, params])
    return s


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
@pytest.mark.parametrize("width", [80, 120])
def test_proposals_stay_below_the_tokenizer(llama_path, params, width):
    s = shard(llama_path, params, width)
    slots = [0, 1]
    for _ in range(3):
        tokens, q = s.propose(slots, 4)
        assert tokens.max() < LIMIT
        if params is GREEDY:
            assert q is None
        else:
            assert q.shape == (2, 4, width) and (q[..., LIMIT:] == 0).all()
        s.commit(slots, tokens.tolist(), [2, 1], [width - 1, 3])  # target padding ids
    s.propose_ahead(slots, 3)
    tokens, q = s.take_ahead(slots, 5)
    assert tokens.shape == (2, 5) and tokens.max() < LIMIT
    window = s.draft_window(slots, tokens, q, 2)
    assert window[0].max() < LIMIT
    assert s.q_width == width
    assert overlap._one_hot(tokens[0], s).shape == (5, width)


def test_without_the_restriction_padding_rows_win(llama_path):
    s = shard(llama_path, GREEDY, 96)
    s.vocab = None
    tokens, _ = s.propose([0, 1], 4)
    assert (tokens >= LIMIT).all()
