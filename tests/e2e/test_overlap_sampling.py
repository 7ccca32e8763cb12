"""Overlapped speculation under `acceptance: tokens` with sampling. Such rounds keep the
target's bonus token (its own sample b) and keep the next window when every draft matched and
the window's first token equals b (runtime.speculation.adaptive.takes_bonus). Every committed
token is the target's own sample with the uniforms of its position, so

- overlap on and off give the same tokens for the same seed, token for token;
- the output follows the target's distribution: draft_len 1, three tokens a request (a kept
  window first shows in the third), chi-square of (first, second), (second, third) and the
  third token against the exact distributions from the target alone (transformers' logits and
  warpers), and against the draft's as a control."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import Engine
from tests import checkpoints, launch
from tests.e2e.test_spec_sampling import (
    PROMPT,
    SAMPLES,
    SETTINGS,
    VOCAB,
    build_target,
    chi_square_p,
    model_and_warpers,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab24-overlap")
    target = build_target(root)
    return checkpoints.build_near_draft(target, root / "near", noise=0.3), target


def exact_triple(model_dir: str, setting: dict) -> np.ndarray:
    """[V, V, V] probability of the first three generated tokens under the model alone."""
    model, warpers = model_and_warpers(model_dir, setting)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)  # [V*V, P+2]
    with torch.no_grad():
        logits = model(ids).logits  # [V*V, P+2, V]
    first = warpers(ids[:1, :-2], logits[:1, -3]).softmax(-1)[0]  # [V]
    second = warpers(ids[::VOCAB, :-1], logits[::VOCAB, -2]).softmax(-1)  # [V, V]
    third = warpers(ids, logits[:, -1]).softmax(-1).view(VOCAB, VOCAB, VOCAB)
    return (first[:, None, None] * second[:, :, None] * third).double().numpy()


def config(pair, tmp_path, draft_len: int, overlap: bool) -> str:
    draft, target = pair
    cfg = launch.write_config(
        tmp_path / f"c-{overlap}.yaml", draft, target, draft_len=draft_len, max_batch_size=256
    )
    launch.set_speculation(cfg, acceptance="tokens", overlap=overlap)
    return cfg


def test_sampled_output_follows_target_with_windows_kept(pair, tmp_path):
    setting = SETTINGS[0]
    with Engine.launch(config(pair, tmp_path, 1, True)) as engine:
        # the first token comes with the prefill; the second round (a fourth token) is the
        # one that can take a window drafted during the first round's verify
        outs = engine.generate(
            prompt_token_ids=[PROMPT] * SAMPLES, max_new_tokens=4, seed=7, **setting
        )
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for out in outs:
        assert len(out.token_ids) == 4
        counts[tuple(out.token_ids[:3])] += 1
    # `tokens` acceptance matches less often than `logits` (alpha about 0.35 here): a window
    # is kept when the first draft and w_1 both match, in about 1 request of 9
    overlapped = sum(out.stats["overlapped_rounds"] for out in outs)
    assert overlapped > SAMPLES // 20, overlapped
    exact, wrong = exact_triple(pair[1], setting), exact_triple(pair[0], setting)
    p_values = [
        chi_square_p(counts.sum(2), exact.sum(2)),  # (first, second)
        chi_square_p(counts.sum(0), exact.sum(0)),  # (second, third)
        chi_square_p(counts.sum((0, 1)), exact.sum((0, 1))),
    ]  # third
    assert min(p_values) > 1e-3, p_values
    assert chi_square_p(counts.sum(2), wrong.sum(2)) < 1e-6, "cannot tell draft from target"


def test_overlap_on_and_off_sample_the_same_tokens(pair, tmp_path):
    prompts = [PROMPT[: 2 + i % 4] + [i % 24] for i in range(12)]  # ragged
    outs = {}
    for overlap in (True, False):
        with Engine.launch(config(pair, tmp_path, 2, overlap)) as engine:
            outs[overlap] = engine.generate(
                prompt_token_ids=prompts, max_new_tokens=24, seed=11, **SETTINGS[3]
            )
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert sum(o.stats["overlapped_rounds"] for o in outs[True]) > 0
    assert sum(o.stats["overlapped_rounds"] for o in outs[False]) == 0
