"""What a newcomer reads first says what works: the README's Quickstart (where to run its two
commands) and docs/serving.md's HTTP examples (a model name the front serves)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]


def test_quickstart_says_to_run_in_a_clone_and_keeps_two_commands():
    text = _quickstart()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks), blocks
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    before = prose.split("The second", 1)[0]
    assert "clone" in before and "`cd`" in before, "the Quickstart must say where to run it"


def test_serving_docs_name_only_models_the_front_serves():
    """docs/serving.md's examples: every literal `model="NAME"` must be a name the front
    answers, which (the target's file name depending on the user's config) is only one the
    docs' own commands give as `--served-model-name NAME`."""
    text = (ROOT / "docs" / "serving.md").read_text()
    served = set(re.findall(r"--served-model-name[ =]([\w.-]+)", text))
    for name in re.findall(r"""\bmodel\s*=\s*["']([^"']+)["']""", text):
        assert name in served, (
            f'docs/serving.md names model="{name}", which the HTTP front answers with 404 '
            f"unless started with --served-model-name {name}"
        )


def test_readme_says_how_to_get_the_http_examples_client():
    """The Quickstart installs no `openai`: the README's OpenAI example says to install it,
    and gives a curl request beside it."""
    readme = (ROOT / "README.md").read_text()
    serving = readme.split("### Serving and the OpenAI API", 1)[1].split("\n## ", 1)[0]
    assert "pip install openai" in serving and "from openai import OpenAI" in serving
    assert re.search(r"```bash\ncurl http://127\.0\.0\.1:8000/v1/completions", serving)


def test_sampling_docs_token_ids_are_the_demos():
    """docs/sampling.md's token ids (logit_bias, stop_token_ids) lie in the demo's vocabulary:
    SmolLM2-135M's 49152 tokens."""
    text = (ROOT / "docs" / "sampling.md").read_text()
    ids = [int(i) for i in re.findall(r"logit_bias=\{(\d+):", text)]
    ids += [
        int(i)
        for ids_ in re.findall(r"stop_token_ids=\[([\d, ]+)\]", text)
        for i in ids_.split(",")
    ]
    assert ids and all(0 <= i < 49152 for i in ids), ids
