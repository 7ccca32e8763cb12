"""The config checks a first run meets: duplicate YAML keys, runtime.max_seq_len against the
models' context, and the KV caches against a CUDA device's memory (each names its key)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from runtime.config import ConfigError, checks, load_config
from runtime.models.loading.checkpoint import inspect_checkpoint
from tests.checkpoints import build_checkpoint

pytestmark = pytest.mark.timeout(60)
GIB = 1024**3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctx")
    return {
        "short": build_checkpoint(root / "short", max_position_embeddings=128),
        "long": build_checkpoint(root / "long", max_position_embeddings=1024),
    }


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def _error(source, key: str, *fragments: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"{key}: "), str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


# --- duplicate keys ----------------------------------------------------------------------
BASE = "draft: {model: /m/d, devices: [cpu:0]}\ntarget: {model: /m/t, devices: [cpu:1]}\n"


@pytest.mark.parametrize(
    "text, key, lines",
    [
        (
            BASE + "runtime:\n  max_seq_len: 64\n  max_batch_size: 2\n  max_seq_len: 128\n",
            "runtime.max_seq_len",
            "lines 4 and 6",
        ),
        (BASE + "tokenizer: /a\ntokenizer: /b\n", "tokenizer", "lines 3 and 4"),
        (
            "draft: {model: /m/d, devices: [cpu:0], model: /m/e}\n"
            "target: {model: /m/t, devices: [cpu:1]}\n",
            "draft.model",
            "twice on line 1",
        ),
        (BASE + "draft: {model: /m/d, devices: [cpu:0]}\n", "draft", "lines 1 and 3"),
    ],
)
def test_duplicate_key_is_an_error_naming_it(tmp_path, text, key, lines):
    message = _error(
        _yaml(tmp_path, text), key, "duplicate key", lines, check_files=False, check_devices=False
    )
    assert message.startswith(f"{key}: duplicate key")


def test_yaml_without_duplicates_still_loads(tmp_path):
    # anchors, aliases and merge keys are no duplicates
    text = (
        "draft: &d {model: /m/d, devices: [cpu:0], dtype: float32}\n"
        "target:\n  <<: *d\n  model: /m/t\n"
        "runtime: {max_seq_len: 64, max_batch_size: 2}\n"
    )
    cfg = load_config(_yaml(tmp_path, text), check_files=False, check_devices=False)
    assert (cfg.target.model, cfg.target.dtype, cfg.runtime.max_seq_len) == ("/m/t", "float32", 64)
    # the same document through plain yaml: the strict reader changes nothing else
    assert yaml.safe_load(text)["target"]["dtype"] == "float32"


# --- max_seq_len against the context ------------------------------------------------------
def _files(draft: str, target: str, **runtime) -> dict:
    cfg = {
        "draft": {"model": draft, "devices": ["cpu:0"]},
        "target": {"model": target, "devices": ["cpu:1"]},
    }
    if runtime:
        cfg["runtime"] = runtime
    return cfg


def test_context_is_read_from_the_checkpoint(models):
    assert inspect_checkpoint(models["short"]).max_position_embeddings == 128
    assert inspect_checkpoint(models["long"]).head_dim == 16  # hidden 64 / 4 heads


@pytest.mark.parametrize(
    "draft, target, which", [("long", "short", "target"), ("short", "long", "draft")]
)
def test_max_seq_len_over_context_names_key_and_both_numbers(models, draft, target, which):
    message = _error(
        _files(models[draft], models[target], max_seq_len=129),
        "runtime.max_seq_len",
        "129",
        "max_position_embeddings is 128",
        f"the {which} model",
        models["short"],
    )
    assert "at most 128" in message


def test_max_seq_len_within_context_is_kept(models):
    cfg = load_config(_files(models["long"], models["short"], max_seq_len=128))
    assert cfg.runtime.max_seq_len == 128


def test_default_max_seq_len_fits_the_smaller_context(models):
    assert load_config(_files(models["long"], models["short"])).runtime.max_seq_len == 128
    assert load_config(_files(models["long"], models["long"])).runtime.max_seq_len == 1024
    # the effective value round-trips as an explicit one
    cfg = load_config(_files(models["long"], models["short"]))
    assert load_config(cfg.to_dict()) == cfg
    # without file checks nothing is read: the plain default
    unchecked = load_config(_files(models["long"], models["short"]), check_files=False)
    assert unchecked.runtime.max_seq_len == 4096


# --- KV caches against a CUDA device's memory ----------------------------------------------
def _cuda_cfg(models, draft_devices=(0,), target_devices=(1,), **model_extra):
    cfg = {
        "draft": {
            "model": models["long"],
            "devices": list(draft_devices),
            "dtype": "float32",
            **model_extra,
        },
        "target": {
            "model": models["long"],
            "devices": list(target_devices),
            "dtype": "float32",
            **model_extra,
        },
        "runtime": {"max_batch_size": 8, "max_seq_len": 1024},
    }
    # no GPU here: parsed without the device checks, then checked with a device's numbers
    return load_config(cfg, check_devices=False)


def _with_memory(monkeypatch, free: int, total: int) -> list[int]:
    asked = []

    def memory(index):
        asked.append(index)
        return free, total

    monkeypatch.setattr(checks, "_nvml_memory", memory)
    return asked


def test_kv_cache_bytes_from_the_checkpoint(models):
    cfg = _cuda_cfg(models)
    info = inspect_checkpoint(models["long"])
    # at least one request: 2 layers x K and V x (the blocks of max_seq_len 1024 and draft
    # room + 1 scratch block) x 2 KV heads x 16 positions a block (runtime.kv_block_size) x
    # head_dim 16 x 4 bytes
    blocks = -(-cfg.kv_seq_len // 16) + 1
    assert cfg.kv_seq_len > 1024 and blocks == 66
    assert checks.kv_cache_bytes(cfg, cfg.draft, info) == 2 * 2 * blocks * 2 * 16 * 16 * 4
    tp2 = _cuda_cfg(models, target_devices=(1, 2))
    assert checks.kv_cache_bytes(tp2, tp2.target, info) == 2 * 2 * blocks * 1 * 16 * 16 * 4
    pool = dataclasses.replace(
        cfg, runtime=dataclasses.replace(cfg.runtime, kv_cache_tokens=16 * 1000)
    )
    assert checks.kv_cache_bytes(pool, pool.draft, info) == 2 * 2 * 1001 * 2 * 16 * 16 * 4
    fp8 = dataclasses.replace(pool, runtime=dataclasses.replace(pool.runtime, kv_cache_dtype="fp8"))
    assert checks.kv_cache_bytes(fp8, fp8.draft, info) == 2 * 2 * 1001 * 2 * 16 * (16 + 4)


def test_kv_caches_that_cannot_fit_the_free_memory(models, monkeypatch):
    need = 2 * 2 * 1001 * 2 * 16 * 16 * 4  # one model's pool of 16,000 tokens
    total = 20 * need  # the 5% reserve: one cache
    shared = _pool(_cuda_cfg(models, draft_devices=(0,), target_devices=(0,)))
    asked = _with_memory(monkeypatch, free=int(2.5 * need), total=total)
    # both caches on cuda:0 need 2 x need, but free less the reserve is 1.5 x need
    with pytest.raises(ConfigError) as info:
        checks.check_kv_memory(shared)
    message = str(info.value)
    assert info.value.key == "runtime.max_seq_len" and "cuda:0" in message, message
    assert "draft 7.8 MiB + target 7.8 MiB" in message, message
    assert "16000 tokens (runtime.kv_cache_tokens)" in message, message
    assert asked == [0]
    apart = _pool(_cuda_cfg(models))  # one pool per device: each fits
    assert _with_memory(monkeypatch, free=int(2.5 * need), total=total) == []
    checks.check_kv_memory(apart)
    _with_memory(monkeypatch, free=int(3.5 * need), total=total)
    checks.check_kv_memory(shared)  # room for both


def _pool(cfg, tokens: int = 16_000):
    return dataclasses.replace(
        cfg, runtime=dataclasses.replace(cfg.runtime, kv_cache_tokens=tokens)
    )


def test_kv_cache_over_its_share(models, monkeypatch):
    need = 2 * 2 * 1001 * 2 * 16 * 16 * 4
    cfg = _pool(_cuda_cfg(models, kv_cache_memory=0.01))
    _with_memory(monkeypatch, free=need * 1000, total=need * 50)  # 1% of it: half a cache
    with pytest.raises(ConfigError) as info:
        checks.check_kv_memory(cfg)
    assert info.value.key == "draft.kv_cache_memory", str(info.value)
    assert "raise draft.kv_cache_memory" in str(info.value)
    _with_memory(monkeypatch, free=need * 1000, total=need * 200)
    checks.check_kv_memory(cfg)


def test_kv_check_skipped_without_nvml_or_on_cpu(models, monkeypatch):
    monkeypatch.setattr(checks, "_nvml_memory", lambda index: None)
    checks.check_kv_memory(_cuda_cfg(models))
    monkeypatch.setattr(checks, "_nvml_memory", lambda index: (0, 1))
    checks.check_kv_memory(load_config(_files(models["long"], models["long"])))  # CPU slots
