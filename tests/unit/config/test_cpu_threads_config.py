"""runtime.cpu_threads: null (auto, the default) or an int >= 1, each CPU worker's intra-op
threads; anything else is a ConfigError that names the key."""

from __future__ import annotations

import pytest

from runtime.config import ConfigError, default_config, load_config

pytestmark = pytest.mark.timeout(60)


def config(runtime: dict | None = None) -> dict:
    return {
        "draft": {"model": "/m/d", "devices": ["cpu:0"]},
        "target": {"model": "/m/t", "devices": ["cpu:0"]},
        "runtime": dict(runtime or {}),
    }


def load(cfg: dict):
    return load_config(cfg, check_files=False, check_devices=False)


def test_auto_is_the_default():
    assert load(config()).runtime.cpu_threads is None
    assert load(config({"cpu_threads": None})).runtime.cpu_threads is None
    assert default_config().runtime.cpu_threads is None


@pytest.mark.parametrize("value", [1, 2, 64])
def test_a_thread_count_is_kept(value):
    cfg = load(config({"cpu_threads": value}))
    assert cfg.runtime.cpu_threads == value
    assert load(cfg.to_dict()).runtime.cpu_threads == value  # --print-config round trip


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", "auto", True, [2]])
def test_anything_else_names_the_key(value):
    with pytest.raises(ConfigError) as info:
        load(config({"cpu_threads": value}))
    assert info.value.key == "runtime.cpu_threads", str(info.value)
    assert str(info.value).startswith("runtime.cpu_threads: "), str(info.value)
