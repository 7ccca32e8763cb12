"""The KV pool's config keys: runtime.kv_cache_tokens (at least one request of max_seq_len
with its draft windows: TandemConfig.kv_seq_len, in whole blocks), runtime.kv_cache_dtype
(auto | fp8) and runtime.prefix_caching (a bool), with their defaults."""

from __future__ import annotations

import pytest

from runtime.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(60)


def config(
    runtime: dict | None = None, same_device: bool = True, draft_len=4, overlap=None
) -> dict:
    spec = {"draft_len": draft_len}
    if overlap is not None:
        spec["overlap"] = overlap
    return {
        "draft": {"model": "/m/d", "devices": ["cpu:0"]},
        "target": {"model": "/m/t", "devices": ["cpu:0" if same_device else "cpu:1"]},
        "speculation": spec,
        "runtime": {"max_seq_len": 100, "kv_block_size": 4, **(runtime or {})},
    }


def load(cfg: dict):
    return load_config(cfg, check_files=False, check_devices=False)


def error(cfg: dict, key: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(cfg)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"{key}: "), str(info.value)
    return str(info.value)


def test_defaults():
    cfg = load(config())
    rt = cfg.runtime
    assert rt.kv_cache_tokens is None
    assert rt.kv_cache_dtype == "auto"
    assert rt.prefix_caching is True
    # no pool size set: the worker sizes it (one request of kv_seq_len at least)
    assert cfg.kv_seq_len == 100 + 4 + 2


@pytest.mark.parametrize(
    "same_device,draft_len,need",
    [
        (True, 4, 108),  # 100 + 4 + 2 = 106 positions, in blocks of 4
        (False, 4, 112),  # overlapped (disjoint devices): two windows, 110 -> 112
        (True, "auto", 112),  # auto drafts up to 8: 110 -> 112
    ],
)
def test_kv_cache_tokens_must_hold_one_request(same_device, draft_len, need):
    base = config(same_device=same_device, draft_len=draft_len)
    assert -(-load(base).kv_seq_len // 4) * 4 == need
    ok = load(config({"kv_cache_tokens": need}, same_device, draft_len))
    assert ok.runtime.kv_cache_tokens == need
    message = error(
        config({"kv_cache_tokens": need - 1}, same_device, draft_len), "runtime.kv_cache_tokens"
    )
    assert str(need) in message and "runtime.max_seq_len" in message, message


def test_kv_cache_tokens_far_too_small_names_the_key():
    message = error(config({"kv_cache_tokens": 16}), "runtime.kv_cache_tokens")
    assert "16 tokens" in message, message


def test_overlap_off_on_disjoint_devices_needs_one_window():
    cfg = config({"kv_cache_tokens": 108}, same_device=False, overlap=False)
    assert load(cfg).runtime.kv_cache_tokens == 108


@pytest.mark.parametrize("value", [0, -5, 1.5, "many", True])
def test_kv_cache_tokens_must_be_a_positive_int(value):
    error(config({"kv_cache_tokens": value}), "runtime.kv_cache_tokens")


def test_kv_cache_tokens_null_is_the_default():
    assert load(config({"kv_cache_tokens": None})).runtime.kv_cache_tokens is None


@pytest.mark.parametrize("value", ["fp16", "FP8", "bf16", "", 8, None])
def test_kv_cache_dtype_refused(value):
    message = error(config({"kv_cache_dtype": value}), "runtime.kv_cache_dtype")
    assert "auto" in message and "fp8" in message, message


@pytest.mark.parametrize("value", ["auto", "fp8"])
def test_kv_cache_dtype_accepted(value):
    assert load(config({"kv_cache_dtype": value})).runtime.kv_cache_dtype == value


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None])
def test_prefix_caching_must_be_a_bool(value):
    error(config({"prefix_caching": value}), "runtime.prefix_caching")


def test_prefix_caching_off():
    assert load(config({"prefix_caching": False})).runtime.prefix_caching is False


def test_yaml_file_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "draft: {model: /m/d, devices: [cpu:0]}\n"
        "target: {model: /m/t, devices: [cpu:0]}\n"
        "speculation: {draft_len: 4}\n"
        "runtime: {max_seq_len: 100, kv_block_size: 4, kv_cache_tokens: 20}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path), check_files=False, check_devices=False)
    assert info.value.key == "runtime.kv_cache_tokens"
    path.write_text(
        path.read_text().replace(
            "kv_cache_tokens: 20", "kv_cache_tokens: 400, prefix_caching: false"
        )
    )
    cfg = load_config(str(path), check_files=False, check_devices=False)
    assert cfg.runtime.kv_cache_tokens == 400 and cfg.runtime.prefix_caching is False
    # the dict a launch writes back (Engine.launch) loads to the same values
    again = load(cfg.to_dict())
    assert again.runtime == cfg.runtime
