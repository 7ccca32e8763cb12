"""The YAMLs in examples/configs/ are valid configs (files and devices are not checked: they
name Hugging Face ids and GPUs this machine has not got)."""
from pathlib import Path

import pytest

from runtime.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.yaml"))


def test_the_five_layouts_ship():
    assert {p.stem for p in CONFIGS} == {"cpu-demo", "one-gpu", "two-gpus", "target-tp2",
                                         "fp8-70b-one-gpu"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_parses(path):
    cfg = load_config(path, check_files=False, check_devices=False)
    assert cfg.overlapped == (path.stem == "two-gpus")
    if path.stem == "fp8-70b-one-gpu":
        assert cfg.target.quantization == cfg.draft.quantization == "fp8"
