"""A draft with a different tokenizer (issue 37): a target speaking words of one or two
letters of "abc" (13 tokens) and a draft speaking characters (5 tokens), tiny random models
(float32, CPU). Their proposals cross as text (runtime.serving.cross_round) and the target
verifies them with `acceptance: tokens`. In one launch: greedy output equals transformers'
greedy output of the target alone, token for token; sampled output follows the target's
exact distribution (chi-square of the first two generated tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Engine
from tests import checkpoints, launch
from tests.e2e.test_spec_sampling import chi_square_p, exact_joint
from tests.tiny_tokenizers import save_text_tokenizer

pytestmark = pytest.mark.timeout(400)

VOCAB = 13  # "<unk>", a, b, c, aa .. cc
PROMPTS = [[4, 1, 7, 2], [9], [1, 2, 3, 12, 5, 6, 11, 10]]
NEW_TOKENS = 20
SAMPLES = 1500
SETTING = {"temperature": 0.8, "top_k": 10}
KW = dict(initializer_range=0.08, eos_token_id=None, bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross")
    target = checkpoints.build_checkpoint(root / "target", seed=20, vocab_size=VOCAB, **KW)
    save_text_tokenizer(target, "abc", words=True)
    draft = checkpoints.build_checkpoint(root / "draft", seed=21, vocab_size=5, **KW)
    save_text_tokenizer(draft, "abc", words=False)
    return draft, target


def test_cross_tokenizer_draft_is_exact(pair, tmp_path):
    draft, target = pair
    reference = [checkpoints.hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    cfg = launch.write_config(tmp_path / "c.yaml", draft, target, draft_len=6, max_batch_size=256)
    with Engine.launch(cfg) as engine:
        outs = engine.generate(prompt_token_ids=PROMPTS, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == reference
        # the draft's proposals reached the target (mapped to its words), one was kept
        assert sum(sum(o.stats["accepted_per_position"]) for o in outs) > 0
        sampled = engine.generate(
            prompt_token_ids=[PROMPTS[0]] * SAMPLES, max_new_tokens=3, seed=7, **SETTING
        )
    counts = np.zeros((VOCAB, VOCAB))
    for out in sampled:
        counts[out.token_ids[0], out.token_ids[1]] += 1
    # proposals were kept: the sampled words came through the draft's mapped proposals
    accepted = sum(sum(o.stats["accepted_per_position"]) for o in sampled)
    assert accepted > SAMPLES // 20, accepted
    probs = exact_joint(target, SETTING, PROMPTS[0], VOCAB)
    p_values = (chi_square_p(counts, probs), chi_square_p(counts.sum(0), probs.sum(0)))
    assert min(p_values) > 1e-3, p_values
