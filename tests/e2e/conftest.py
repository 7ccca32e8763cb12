"""Fixtures shared by the end-to-end tests (launches, faults, serving)."""

import pytest

from tests import checkpoints


@pytest.fixture(scope="session")
def tokenized_pair(tmp_path_factory) -> tuple[str, str]:
    """(draft, target): a tiny Llama target with a tokenizer and a draft near it (weights
    with 5% noise, so it agrees with the target often but not always), built once per run."""
    root = tmp_path_factory.mktemp("pair")
    target = checkpoints.build_with_tokenizer(root / "target", seed=0)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return draft, target
