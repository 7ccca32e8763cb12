"""Fixtures shared by the unit tests (no processes)."""

import pytest

from tests.checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    """A tiny float32 Llama checkpoint (config.json + safetensors), built once per run."""
    return build_checkpoint(tmp_path_factory.mktemp("unit") / "llama", seed=3)
