"""The config cache (runtime.models.loading.portable_config): a config read once through
transformers
comes back from the cache as a PortableConfig that our model reads exactly as the real one,
without importing transformers; other configs are never cached; the key follows config.json."""

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.models.arch.model_args import ModelArgs
from runtime.models.arch.rope import compute_inv_freq
from runtime.models.loading import disk_cache, gguf_cache, loader, portable_config
from runtime.models.loading.portable_config import PortableConfig
from tests import checkpoints

CASES = {
    "llama": dict(arch="llama"),
    "llama-tied-theta": dict(arch="llama", tie_word_embeddings=True, rope_theta=50000.0),
    "mistral-window": dict(arch="mistral", sliding_window=16),
    "qwen2-window": dict(
        arch="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
    ),
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache of this test's own: identical config.json files elsewhere share entries."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def _fields(config) -> dict:
    args = ModelArgs.from_hf_config(config)
    return {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "hf_config"
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_config_reads_as_the_transformers_one(tmp_path, case):
    kwargs = dict(CASES[case])
    path = checkpoints.build_checkpoint(tmp_path / case, kwargs.pop("arch"), **kwargs)
    first, second = loader.load_config(path), loader.load_config(path)
    assert not isinstance(first, PortableConfig) and isinstance(second, PortableConfig)
    assert _fields(second) == _fields(first)
    assert second.to_dict() == first.to_dict()
    assert second.name_or_path == first.name_or_path == path
    for got, want in zip(compute_inv_freq(second, 16), compute_inv_freq(first, 16)):
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    assert gguf_cache.weights_key(second, ["a"]) == gguf_cache.weights_key(first, ["a"])
    copied = copy.deepcopy(second)  # a draft that is the target copies its model
    assert isinstance(copied, PortableConfig) and copied.to_dict() == second.to_dict()


def test_model_from_cached_config_gives_the_same_logits(tmp_path):
    path = checkpoints.build_checkpoint(tmp_path / "m", "qwen2")
    ids, zero, one = torch.tensor([[1, 5, 9, 13]]), torch.tensor([0]), torch.tensor([4])

    def logits():
        model = loader.load_model(path, torch.float32, "cpu")
        model.allocate_cache(1, 16)
        return type(model.args.hf_config), model.forward_extend(ids, zero, zero, one)

    (kind_a, a), (kind_b, b) = logits(), logits()
    assert kind_a is not PortableConfig and kind_b is PortableConfig
    assert torch.equal(a, b)


def test_a_later_start_does_not_import_transformers(tmp_path):
    path = checkpoints.build_checkpoint(tmp_path / "m")
    loader.load_config(path)  # fills the cache
    code = (
        "import sys, torch; from runtime.models import load_model; "
        f"load_model({path!r}, torch.float32, 'cpu'); "
        "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_other_rope_types_are_never_cached(tmp_path):
    path = checkpoints.build_checkpoint(
        tmp_path / "m",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert not isinstance(loader.load_config(path), PortableConfig)
    assert not isinstance(loader.load_config(path), PortableConfig)


def test_a_changed_config_json_is_read_again(tmp_path):
    path = Path(checkpoints.build_checkpoint(tmp_path / "m"))
    assert loader.load_config(path).rms_norm_eps == 1e-5
    values = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(values, rms_norm_eps=1e-3)))
    config = loader.load_config(path)
    assert not isinstance(config, PortableConfig) and config.rms_norm_eps == 1e-3
    assert loader.load_config(path).rms_norm_eps == 1e-3


def test_a_broken_entry_is_rebuilt(tmp_path, caplog):
    path = checkpoints.build_checkpoint(tmp_path / "m")
    loader.load_config(path)
    entry = disk_cache.cache_root() / "configs" / portable_config._key(Path(path))
    (entry / portable_config.FILE).write_text("{not json")
    manifest = json.loads((entry / disk_cache.MANIFEST).read_text())
    (entry / disk_cache.MANIFEST).write_text(
        json.dumps(dict(manifest, **{portable_config.FILE: len("{not json")}))
    )
    config = loader.load_config(path)
    assert not isinstance(config, PortableConfig) and config.hidden_size == 64
    assert "broken" in caplog.text
    assert isinstance(loader.load_config(path), PortableConfig)
