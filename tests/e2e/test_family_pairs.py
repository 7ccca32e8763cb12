"""Issue 37's native families end to end, one Engine each: Qwen3 and OLMo 2 targets at TP 2
(cpu:1-2), Gemma 3 (soft-capped logits, sliding and full layers, two RoPE tables), Phi-3 and
Gemma 2 targets on cpu:1, each with a same-family draft on cpu:0. Greedy output equals the
target's own transformers greedy output token for token (float32, CPU), also for prompts that
find their prefix in the paged cache (blocks of 4 tokens). tests/unit/models/test_families.py and
test_gemma.py cover the families' logits, TP 2, FP8 and the kernels without processes."""

from __future__ import annotations

import pytest

from runtime import Engine
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)

PREFIX = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]  # three blocks of 4
TAILS = [[60, 61, 62], [2, 33], [77, 3, 8, 64, 65]]
NEW_TOKENS = 16


@pytest.mark.parametrize(
    "arch,target_devices",
    [
        ("qwen3", ["cpu:1", "cpu:2"]),
        ("gemma3_text", ["cpu:1"]),
        ("olmo2", ["cpu:1", "cpu:2"]),
        ("phi3", ["cpu:1"]),
        ("gemma2", ["cpu:1"]),
    ],
)
def test_family_pair_greedy_equals_transformers_with_prefix_hits(arch, target_devices, tmp_path):
    target = checkpoints.build_checkpoint(tmp_path / "target", arch, seed=7)
    draft = checkpoints.build_near_draft(target, tmp_path / "draft", noise=0.05)
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        draft,
        target,
        ["cpu:0"],
        target_devices,
        draft_len=4,
        kv_block_size=4,
        max_seq_len=64,
    )
    prompts = [PREFIX + tail for tail in TAILS]
    with Engine.launch(cfg) as engine:
        first = engine.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS)
        rest = engine.generate(prompt_token_ids=prompts[1:], max_new_tokens=NEW_TOKENS)
    outs = [first, *rest]
    want = [checkpoints.hf_greedy(target, p, NEW_TOKENS) for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert all(o.stats["cached_prompt_tokens"] == len(PREFIX) for o in rest), [
        o.stats for o in rest
    ]
    assert sum(o.stats["acceptance_rate"] for o in outs) / len(outs) > 0.3, [o.stats for o in outs]
