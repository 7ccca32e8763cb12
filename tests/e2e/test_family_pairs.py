"""Qwen3 (issue 37's native families) end to end: a Qwen3 target at TP 2 (cpu:1-2) with a
Qwen3 draft on cpu:0, greedy: the output equals the target's own transformers greedy output
token for token (float32, CPU). One launch; tests/unit/models/test_families.py covers the
families' logits, TP 2 and FP8 without processes."""
from __future__ import annotations

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 77, 3, 8, 60, 61, 62, 63, 64, 65, 2, 33]]
NEW_TOKENS = 20


def test_qwen3_tp2_target_greedy_equals_transformers(tmp_path):
    target = checkpoints.build_checkpoint(tmp_path / "target", "qwen3", seed=7)
    draft = checkpoints.build_near_draft(target, tmp_path / "draft", noise=0.05)
    draft_devices, target_devices = ["cpu:0"], ["cpu:1", "cpu:2"]
    cfg = launch.write_config(tmp_path / "c.yaml", draft, target, draft_devices,
                              target_devices, draft_len=4)
    args = ["run", cfg, "--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    outs = launch.run_json("spawn", launch.world_size(draft_devices, target_devices), args)
    want = [checkpoints.hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    assert [o["token_ids"] for o in outs] == want
    assert all(o["stats"]["acceptance_rate"] > 0.3 for o in outs), [o["stats"] for o in outs]
