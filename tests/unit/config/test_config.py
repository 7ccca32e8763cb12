"""runtime.config: parsing, defaults, every validation error (each must name its key)."""

from __future__ import annotations

import os
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
import yaml

from runtime.config import (
    ConfigError,
    Device,
    ModelConfig,
    RuntimeConfig,
    ServerConfig,
    SpeculationConfig,
    TandemConfig,
    default_config,
    load_config,
    parse_device,
)
from tests.checkpoints import build_checkpoint, smollm2_gguf

pytestmark = pytest.mark.timeout(60)


def _base(**overrides) -> dict:
    """A minimal valid dict config on CPU slots (paths need not exist: check_files=False)."""
    cfg = {
        "draft": {"model": "/models/draft", "devices": ["cpu:0"]},
        "target": {"model": "/models/target", "devices": ["cpu:1", "cpu:2"]},
    }
    cfg.update(overrides)
    return cfg


def _load(cfg, **kwargs):
    kwargs.setdefault("check_files", False)
    kwargs.setdefault("check_devices", False)
    return load_config(cfg, **kwargs)


def _error(cfg, key: str, *fragments: str, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _load(cfg, **kwargs)
    err = info.value
    assert err.key == key, str(err)
    assert str(err).startswith(f"{key}: "), str(err)
    for fragment in fragments:
        assert fragment in str(err), str(err)
    return err


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, Device("cuda", 0)),
        (3, Device("cuda", 3)),
        ("1", Device("cuda", 1)),
        ("cuda:1", Device("cuda", 1)),
        ("cuda", Device("cuda", 0)),
        ("cpu", Device("cpu", 0)),
        ("cpu:0", Device("cpu", 0)),
        ("cpu:7", Device("cpu", 7)),
        (" CPU:2 ", Device("cpu", 2)),
        (Device("cpu", 4), Device("cpu", 4)),
    ],
)
def test_device_parse(value, expected):
    assert Device.parse(value) == expected
    assert parse_device(value, "x.devices") == expected


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        1.0,
        0.5,
        -1,
        "-1",
        "cpu:-1",
        "gpu:0",
        "cuda:",
        "cpu:a",
        "",
        None,
        [0],
        {"cpu": 0},
        "0x1",
    ],
)
def test_device_parse_rejects(value):
    with pytest.raises(ConfigError) as info:
        parse_device(value, "target.devices")
    assert info.value.key == "target.devices"
    assert str(info.value).startswith("target.devices: ")


def test_device_str_and_torch_device():
    assert str(Device("cuda", 1)) == "cuda:1"
    assert str(Device("cpu", 1)) == "cpu:1"
    assert Device("cuda", 1).torch_device == torch.device("cuda", 1)
    assert Device("cpu", 3).torch_device == torch.device("cpu")
    with pytest.raises(ValueError):
        Device("tpu", 0)
    with pytest.raises(ValueError):
        Device("cpu", -1)


def test_defaults_from_minimal_config():
    cfg = _load(_base())
    assert cfg.draft == ModelConfig("/models/draft", (Device("cpu", 0),), "bfloat16")
    assert cfg.target.devices == (Device("cpu", 1), Device("cpu", 2))
    assert cfg.target.tp_size == 2 and cfg.draft.tp_size == 1
    assert cfg.draft.torch_dtype == torch.bfloat16
    assert cfg.tokenizer is None and cfg.tokenizer_path == "/models/target"
    assert cfg.speculation == SpeculationConfig() == SpeculationConfig(4, "tokens")
    assert cfg.speculation.verification == "block"  # measured: docs/sampling.md
    assert cfg.runtime == RuntimeConfig()
    assert cfg.runtime.cuda_graphs is True and cfg.target.kv_cache_memory is None
    assert (cfg.runtime.max_batch_size, cfg.runtime.max_seq_len) == (8, 4096)
    assert (cfg.runtime.startup_timeout_s, cfg.runtime.step_timeout_s, cfg.runtime.heartbeat_s) == (
        300.0,
        120.0,
        1.0,
    )
    assert cfg.server == ServerConfig("tcp://127.0.0.1:5555")


def test_full_config_values():
    cfg = _load(
        _base(
            draft={"model": "/m/d", "devices": [0], "dtype": "float16"},
            target={"model": "/m/t", "devices": [1, "2", "cuda:3"], "dtype": "float32"},
            tokenizer="/m/tok",
            speculation={"draft_len": 7, "acceptance": "logits", "verification": "block"},
            runtime={
                "max_batch_size": 2,
                "max_seq_len": 2,
                "startup_timeout_s": 5,
                "step_timeout_s": 0.5,
                "heartbeat_s": 0.1,
            },
            server={"address": "ipc:///tmp/tandem.sock"},
        )
    )
    assert cfg.target.devices == tuple(Device("cuda", i) for i in (1, 2, 3))
    assert cfg.draft.torch_dtype == torch.float16 and cfg.target.torch_dtype == torch.float32
    assert cfg.tokenizer_path == "/m/tok"
    assert cfg.speculation == SpeculationConfig(7, "logits", verification="block")
    assert cfg.runtime.startup_timeout_s == 5.0 and isinstance(cfg.runtime.startup_timeout_s, float)
    assert cfg.server.address == "ipc:///tmp/tandem.sock"


def test_empty_optional_sections_mean_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "draft: {model: /d, devices: [cpu]}\ntarget: {model: /t, devices: [cpu]}\n"
        "speculation:\nruntime:\nserver:\ntokenizer:\n"
    )
    cfg = _load(path)
    assert cfg.speculation == SpeculationConfig() and cfg.tokenizer is None


def test_default_config():
    cfg = default_config()
    gguf = smollm2_gguf()
    assert cfg.draft.model == cfg.target.model
    assert os.path.samefile(cfg.draft.model, gguf) and os.path.isabs(cfg.draft.model)
    assert cfg.draft.devices == cfg.target.devices == (Device("cpu", 0),)
    assert cfg.draft.dtype == cfg.target.dtype == "float32"
    assert cfg.speculation == SpeculationConfig(4, "tokens")
    assert (cfg.runtime.max_batch_size, cfg.runtime.max_seq_len) == (8, 2048)
    assert cfg.tokenizer is None and cfg.tokenizer_path == cfg.target.model
    # it is itself a valid config, files and all
    assert load_config(cfg.to_dict()) == cfg


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float))


@pytest.mark.parametrize(
    "cfg",
    [
        _base(),
        _base(
            draft={"model": "/a", "devices": [0, 1], "dtype": "float32"},
            target={"model": "/b", "devices": ["cuda:1"]},
            tokenizer="/tok",
            speculation={"draft_len": 2, "acceptance": "logits"},
            runtime={"max_batch_size": 3, "heartbeat_s": 0.25},
            server={"address": "tcp://0.0.0.0:6000", "auth_key_file": "/etc/tandem.key"},
        ),
    ],
)
def test_round_trip_to_dict(cfg):
    loaded = _load(cfg)
    data = loaded.to_dict()
    assert _plain(data)
    assert _load(data) == loaded
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_relative_paths_resolve_against_yaml_dir(tmp_path, monkeypatch):
    sub = tmp_path / "configs"
    sub.mkdir()
    path = sub / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            _base(
                draft={"model": "models/d", "devices": ["cpu:0"]},
                target={"model": "../t.gguf", "devices": ["cpu:0"]},
                tokenizer="tok",
            )
        )
    )
    monkeypatch.chdir("/")
    cfg = _load(str(path))
    assert cfg.draft.model == str(sub / "models" / "d")
    assert cfg.target.model == str(tmp_path / "t.gguf")
    assert cfg.tokenizer == str(sub / "tok")
    assert _load(Path(path)) == cfg


def test_relative_paths_in_dict_resolve_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _load(_base(draft={"model": "d", "devices": ["cpu"]}, tokenizer="./tok"))
    assert cfg.draft.model == str(tmp_path / "d")
    assert cfg.tokenizer == str(tmp_path / "tok")
    assert cfg.target.model == "/models/target"


def test_missing_yaml(tmp_path):
    # the error starts with the file's real path (no placeholder such as `<file>:`)
    path = str(tmp_path / "nope.yaml")
    err = _error(path, path, "does not exist")
    assert "<file>" not in str(err)


def test_missing_yaml_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _error("nope.yaml", str(tmp_path / "nope.yaml"), "does not exist")


def test_directory_as_yaml(tmp_path):
    _error(str(tmp_path), str(tmp_path), "is a directory")


def test_unparsable_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("draft: [unclosed\n  target: {")
    err = _error(str(path), str(path), "YAML")
    assert "<file>" not in str(err)


@pytest.mark.parametrize("text", ["", "- 1\n- 2\n", "just a string\n"])
def test_top_level_not_mapping(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _error(str(path), str(path), "mapping")


@pytest.mark.parametrize(
    "cfg, key",
    [
        (_base(drafts={}), "drafts"),
        (_base(draft={"model": "/d", "devices": [0], "dtyp": "float32"}), "draft.dtyp"),
        (_base(target={"model": "/t", "devices": [0], "tp": 2}), "target.tp"),
        (_base(speculation={"draft_length": 4}), "speculation.draft_length"),
        (_base(runtime={"max_batch_sz": 4}), "runtime.max_batch_sz"),
        (_base(server={"host": "x"}), "server.host"),
    ],
)
def test_unknown_keys(cfg, key):
    _error(cfg, key, "unknown key")


def test_unknown_key_suggests():
    _error(_base(runtime={"max_batch_sz": 4}), "runtime.max_batch_sz", "max_batch_size")


@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"target": {"model": "/t", "devices": [0]}}, "draft"),
        ({"draft": {"model": "/d", "devices": [0]}}, "target"),
        (_base(draft={"devices": [0]}), "draft.model"),
        (_base(target={"model": "/t"}), "target.devices"),
    ],
)
def test_missing_required(cfg, key):
    _error(cfg, key, "missing")


@pytest.mark.parametrize(
    "cfg, key",
    [
        (_base(draft="/d"), "draft"),
        (_base(target=[1]), "target"),
        (_base(speculation=4), "speculation"),
        (_base(runtime=["max_batch_size"]), "runtime"),
        (_base(server="tcp://x"), "server"),
        (_base(draft={"model": 3, "devices": [0]}), "draft.model"),
        (_base(target={"model": "", "devices": [0]}), "target.model"),
        (_base(draft={"model": "/d", "devices": 0}), "draft.devices"),
        (_base(target={"model": "/t", "devices": "cpu:0"}), "target.devices"),
        (_base(draft={"model": "/d", "devices": [True]}), "draft.devices"),
        (_base(draft={"model": "/d", "devices": [1.0]}), "draft.devices"),
        (_base(target={"model": "/t", "devices": [-1]}), "target.devices"),
        (_base(target={"model": "/t", "devices": ["gpu1"]}), "target.devices"),
        (_base(tokenizer=5), "tokenizer"),
        (_base(speculation={"draft_len": "4"}), "speculation.draft_len"),
        (_base(speculation={"draft_len": True}), "speculation.draft_len"),
        (_base(speculation={"draft_len": 4.0}), "speculation.draft_len"),
        (_base(speculation={"acceptance": 1}), "speculation.acceptance"),
        (_base(runtime={"max_batch_size": "8"}), "runtime.max_batch_size"),
        (_base(runtime={"max_seq_len": True}), "runtime.max_seq_len"),
        (_base(runtime={"step_timeout_s": "10"}), "runtime.step_timeout_s"),
        (_base(runtime={"heartbeat_s": False}), "runtime.heartbeat_s"),
        (_base(runtime={"cuda_graphs": "yes"}), "runtime.cuda_graphs"),
        (_base(runtime={"cuda_graphs": 1}), "runtime.cuda_graphs"),
        (
            _base(target={"model": "/t", "devices": ["cpu:1"], "kv_cache_memory": "half"}),
            "target.kv_cache_memory",
        ),
        (_base(server={"address": 5555}), "server.address"),
    ],
)
def test_wrong_types(cfg, key):
    _error(cfg, key)


@pytest.mark.parametrize(
    "devices, key",
    [
        ([], "must list at least one device"),
        (["cpu:0", "cpu:1", "cpu:0"], "device cpu:0 is listed twice"),
        (["cpu", "cpu:0"], "device cpu:0 is listed twice"),
    ],
)
def test_bad_device_lists(devices, key):
    _error(_base(target={"model": "/t", "devices": devices}), "target.devices", key)


def test_cuda_duplicates_in_different_spellings():
    _error(
        _base(
            draft={"model": "/d", "devices": [0, "cuda:0"]}, target={"model": "/t", "devices": [0]}
        ),
        "draft.devices",
        "cuda:0 is listed twice",
    )


@pytest.mark.parametrize(
    "draft, target, key",
    [
        (["cpu:0"], [0], "target.devices"),
        ([0], ["cpu:0", "cpu:1"], "target.devices"),
        ([0, "cpu:1"], [0], "draft.devices"),
        (["cpu"], ["cpu:1", "cuda:1"], "target.devices"),
    ],
)
def test_mixed_backends(draft, target, key):
    _error(
        _base(draft={"model": "/d", "devices": draft}, target={"model": "/t", "devices": target}),
        key,
        "one backend per run",
    )


@pytest.mark.parametrize(
    "section, value, key",
    [
        ("draft", {"model": "/d", "devices": [0], "dtype": "fp16"}, "draft.dtype"),
        ("target", {"model": "/t", "devices": [0], "dtype": "int8"}, "target.dtype"),
        ("speculation", {"draft_len": 0}, "speculation.draft_len"),
        ("speculation", {"draft_len": -3}, "speculation.draft_len"),
        ("speculation", {"acceptance": "greedy"}, "speculation.acceptance"),
        ("speculation", {"verification": "tokens"}, "speculation.verification"),
        ("speculation", {"verification": True}, "speculation.verification"),
        ("runtime", {"max_batch_size": 0}, "runtime.max_batch_size"),
        ("runtime", {"max_seq_len": 1}, "runtime.max_seq_len"),
        ("runtime", {"startup_timeout_s": 0}, "runtime.startup_timeout_s"),
        ("runtime", {"step_timeout_s": -1.0}, "runtime.step_timeout_s"),
        ("runtime", {"heartbeat_s": 0.0}, "runtime.heartbeat_s"),
        ("runtime", {"heartbeat_s": float("nan")}, "runtime.heartbeat_s"),
        ("draft", {"model": "/d", "devices": [0], "kv_cache_memory": 0}, "draft.kv_cache_memory"),
        (
            "target",
            {"model": "/t", "devices": [0], "kv_cache_memory": 1.5},
            "target.kv_cache_memory",
        ),
        (
            "target",
            {"model": "/t", "devices": [0], "kv_cache_memory": float("inf")},
            "target.kv_cache_memory",
        ),
        ("server", {"address": "http://127.0.0.1:5555"}, "server.address"),
        ("server", {"address": "127.0.0.1:5555"}, "server.address"),
        ("server", {"shutdown_timeout_s": -1}, "server.shutdown_timeout_s"),
        ("server", {"shutdown_timeout_s": float("nan")}, "server.shutdown_timeout_s"),
        ("server", {"shutdown_timeout_s": "30s"}, "server.shutdown_timeout_s"),
    ],
)
def test_bad_values(section, value, key):
    cfg = _base()
    if section in ("draft", "target"):
        value = dict(value, devices=["cpu:0"])
    cfg[section] = value
    _error(cfg, key)


def test_section_dataclasses_validate_directly():
    with pytest.raises(ConfigError, match=r"^speculation\.draft_len: "):
        SpeculationConfig(draft_len=0)
    with pytest.raises(ConfigError, match=r"^runtime\.max_seq_len: "):
        RuntimeConfig(max_seq_len=1)
    with pytest.raises(ConfigError, match=r"^server\.address: "):
        ServerConfig(address="udp://x")


def test_bad_source_type():
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]


def test_cuda_device_count_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = _base(draft={"model": "/d", "devices": [0]}, target={"model": "/t", "devices": [1]})
    assert _load(cfg, check_devices=True).target.devices == (Device("cuda", 1),)
    bad = _base(draft={"model": "/d", "devices": [0]}, target={"model": "/t", "devices": [1, 2]})
    _error(bad, "target.devices", "cuda:2", "2 CUDA device", check_devices=True)
    assert _load(bad).target.tp_size == 2  # check_devices=False skips it


def test_devices_naming_their_node_are_checked_on_that_node(monkeypatch):
    """A config naming nodes leaves each node's CUDA indices to the ranks there
    (runtime.config.nodes): the config check here counts none of them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = _base(
        draft={"model": "/d", "devices": ["n0:0"]},
        target={"model": "/t", "devices": ["n1:0", "n1:1"]},
    )
    assert _load(cfg, check_devices=True).target.devices[1] == Device("cuda", 1, node=1)
    _error(
        _base(draft={"model": "/d", "devices": [0]}, target={"model": "/t", "devices": [1]}),
        "target.devices",
        "1 CUDA device",
        check_devices=True,
    )


def test_no_cuda_at_all(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    _error(
        _base(draft={"model": "/d", "devices": [0]}, target={"model": "/t", "devices": [0]}),
        "draft.devices",
        "0 CUDA device",
        check_devices=True,
    )


def test_cpu_slots_need_no_hardware():
    cfg = _base(
        draft={"model": "/d", "devices": ["cpu:63"]},
        target={"model": "/t", "devices": ["cpu:0", "cpu:100"]},
    )
    assert _load(cfg, check_devices=True).target.devices[1] == Device("cpu", 100)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "a": build_checkpoint(root / "a", vocab_size=96),
        "b": build_checkpoint(root / "b", arch="qwen2", vocab_size=96, seed=1),
        "c": build_checkpoint(root / "c", vocab_size=128),
    }


def _files_cfg(draft: str, target: str, **extra) -> dict:
    return dict(
        {
            "draft": {"model": draft, "devices": ["cpu:0"]},
            "target": {"model": target, "devices": ["cpu:1"]},
        },
        **extra,
    )


def test_files_ok(tiny_pair):
    cfg = load_config(_files_cfg(tiny_pair["a"], tiny_pair["b"]))
    assert cfg.draft.model == tiny_pair["a"]


@pytest.mark.parametrize("which", ["draft", "target"])
def test_model_path_missing(tmp_path, tiny_pair, which):
    paths = {"draft": tiny_pair["a"], "target": tiny_pair["a"]}
    paths[which] = str(tmp_path / "missing")
    _error(
        _files_cfg(paths["draft"], paths["target"]),
        f"{which}.model",
        "missing",
        "does not exist",
        check_files=True,
    )


def test_model_dir_without_config_json(tmp_path, tiny_pair):
    (tmp_path / "empty").mkdir()
    _error(
        _files_cfg(tiny_pair["a"], str(tmp_path / "empty")),
        "target.model",
        "config.json",
        check_files=True,
    )


def test_tokenizer_path_missing(tmp_path, tiny_pair):
    _error(
        _files_cfg(tiny_pair["a"], tiny_pair["a"], tokenizer=str(tmp_path / "tok")),
        "tokenizer",
        "does not exist",
        check_files=True,
    )


def test_tokenizer_path_without_tokenizer_files(tmp_path, tiny_pair):
    """An explicit tokenizer dir must hold one; the target's own dir need not (no text)."""
    (tmp_path / "tok").mkdir()
    _error(
        _files_cfg(tiny_pair["a"], tiny_pair["a"], tokenizer=str(tmp_path / "tok")),
        "tokenizer",
        "no tokenizer files",
        "tokenizer.json",
        check_files=True,
    )
    (tmp_path / "tok.txt").write_text("x")
    _error(
        _files_cfg(tiny_pair["a"], tiny_pair["a"], tokenizer=str(tmp_path / "tok.txt")),
        "tokenizer",
        "not a .gguf file",
        check_files=True,
    )
    assert load_config(_files_cfg(tiny_pair["a"], tiny_pair["a"])).tokenizer is None


def test_vocab_mismatch(tiny_pair):
    err = _error(
        _files_cfg(tiny_pair["a"], tiny_pair["c"]), "draft.model", "96", "128", check_files=True
    )
    assert "vocab" in str(err)
    assert _load(_files_cfg(tiny_pair["a"], tiny_pair["c"])).draft.model == tiny_pair["a"]


def test_files_checked_from_yaml(tmp_path, tiny_pair):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(_files_cfg(os.path.relpath(tiny_pair["a"], tmp_path), tiny_pair["c"]))
    )
    _error(str(path), "draft.model", "vocab", check_files=True)


def test_config_equality_and_hash():
    a, b = _load(_base()), _load(_base())
    assert a == b and hash(a) == hash(b)
    assert isinstance(a, TandemConfig)
    with pytest.raises(FrozenInstanceError):
        a.draft = a.target  # type: ignore[misc]


def test_non_loopback_server_needs_a_key(tmp_path):
    with pytest.raises(ConfigError, match="server.address"):
        _load(_base(server={"address": "tcp://0.0.0.0:6000"}))
    assert _load(_base(server={"address": "tcp://127.0.0.1:6000"})).server.auth_key_file is None
    key = tmp_path / "key"
    key.write_text("short")
    key.chmod(0o600)
    cfg = _base(server={"address": "tcp://0.0.0.0:6000", "auth_key_file": str(key)})
    with pytest.raises(ConfigError, match="server.auth_key_file"):
        load_config(cfg, check_files=True, check_devices=False)


def test_draft_len_auto():
    cfg = _load(_base(speculation={"draft_len": "auto"}))
    assert cfg.speculation.fixed_draft_len is None and cfg.speculation.max_draft_len == 8
    assert _load(_base(speculation={"draft_len": 3})).speculation.max_draft_len == 3
    for bad in ("AUTO", "4", 0, 2.5):
        with pytest.raises(ConfigError, match="speculation.draft_len"):
            _load(_base(speculation={"draft_len": bad}))


def test_kv_cache_memory_and_cuda_graphs_round_trip():
    cfg = _load(
        _base(
            target={"model": "/t", "devices": ["cpu:1"], "kv_cache_memory": 0.25},
            runtime={"cuda_graphs": False},
        )
    )
    assert cfg.target.kv_cache_memory == 0.25 and cfg.draft.kv_cache_memory is None
    assert cfg.runtime.cuda_graphs is False
    again = _load(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize("value", [0, 2.5])
def test_shutdown_timeout_of_zero_or_more_seconds_is_taken(value):
    assert _load(_base(server={"shutdown_timeout_s": value})).server.shutdown_timeout_s == value
    assert ServerConfig().shutdown_timeout_s == 20.0  # within Kubernetes' 30 s grace period
