"""`tandem bench`'s KV cache flags reach the spec modes' Engine config (runtime section)
and the report's settings: prefix caching off unless --prefix-caching, --max-seq-len,
--kv-cache-tokens, --kv-cache-dtype; no model is loaded (a synthetic recipe pair is a
config and a recipe file)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pytest
import torch

from launcher import bench as cli
from runtime.bench.settings import BenchSettings, resolve
from runtime.config import load_config
from tests import launch


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def _synthetic(tmp_path, **values) -> BenchSettings:
    return BenchSettings(
        synthetic="tiny",
        device="cpu",
        modes=["spec"],
        prompt_len=8,
        new_tokens=8,
        synthetic_dir=str(tmp_path),
        **values,
    )


def test_flags_default_to_prefix_caching_off():
    args = _parse("--synthetic", "tiny")
    assert args.prefix_caching is False
    assert (args.max_seq_len, args.kv_cache_tokens, args.kv_cache_dtype) == (None,) * 3
    args = _parse(
        "--prefix-caching",
        "--max-seq-len",
        "512",
        "--kv-cache-tokens",
        "4096",
        "--kv-cache-dtype",
        "fp8",
    )
    assert (args.prefix_caching, args.max_seq_len, args.kv_cache_tokens, args.kv_cache_dtype) == (
        True,
        512,
        4096,
        "fp8",
    )
    for bad in (["--kv-cache-dtype", "int8"], ["--max-seq-len", "0"]):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_synthetic_defaults(tmp_path):
    rt = resolve(_synthetic(tmp_path)).engine_config["runtime"]
    assert rt["prefix_caching"] is False
    assert rt["max_seq_len"] == 8 + 8 + 4 + 8
    assert "kv_cache_dtype" not in rt
    # the pool: every row of the largest batch at max_seq_len with two draft windows' room
    # (whole blocks), not all free memory; the engine's config accepts it
    assert rt["kv_cache_tokens"] >= rt["max_batch_size"] * (28 + 2 * 4 + 2)
    load_config(resolve(_synthetic(tmp_path)).engine_config, check_devices=False)


def test_synthetic_kv_settings_reach_a_valid_engine_config(tmp_path):
    st = resolve(
        _synthetic(
            tmp_path,
            prefix_caching=True,
            max_seq_len=512,
            kv_cache_tokens=2048,
            kv_cache_dtype="fp8",
        )
    )
    rt = st.engine_config["runtime"]
    assert (
        rt["prefix_caching"],
        rt["max_seq_len"],
        rt["kv_cache_tokens"],
        rt["kv_cache_dtype"],
    ) == (True, 512, 2048, "fp8")
    cfg = load_config(st.engine_config, check_devices=False).runtime
    assert (cfg.prefix_caching, cfg.max_seq_len, cfg.kv_cache_tokens, cfg.kv_cache_dtype) == (
        True,
        512,
        2048,
        "fp8",
    )


def test_max_seq_len_beyond_the_synthetic_context(tmp_path):
    """A synthetic pair's context (8192) is raised to --max-seq-len, in a pair of its own."""
    st = resolve(_synthetic(tmp_path, max_seq_len=32768))
    assert st.engine_config["runtime"]["max_seq_len"] == 32768
    assert st.target.endswith("-ctx32768/target")
    for path in (st.draft, st.target):
        config = json.loads((Path(path) / "config.json").read_text())
        assert config["max_position_embeddings"] == 32768
    assert load_config(st.engine_config, check_devices=False).runtime.max_seq_len == 32768
    assert not resolve(_synthetic(tmp_path)).target.endswith("-ctx32768/target")


def test_config_run(tmp_path):
    from runtime.models.loading.synthetic import build_pair

    draft, target = build_pair(tmp_path, "tiny", 2, materialize=False)
    path = launch.write_config(
        tmp_path / "c.yaml", draft, target, max_seq_len=1024, kv_cache_dtype="fp8"
    )
    rt = resolve(
        BenchSettings(config=path, synthetic=None, prompt_len=8, new_tokens=8)
    ).engine_config["runtime"]
    assert (rt["prefix_caching"], rt["max_seq_len"], rt["kv_cache_dtype"]) == (False, 1024, "fp8")
    rt = resolve(
        BenchSettings(
            config=path,
            synthetic=None,
            prompt_len=8,
            new_tokens=8,
            prefix_caching=True,
            max_seq_len=64,
            kv_cache_tokens=512,
            kv_cache_dtype="auto",
        )
    ).engine_config["runtime"]
    assert (
        rt["prefix_caching"],
        rt["max_seq_len"],
        rt["kv_cache_tokens"],
        rt["kv_cache_dtype"],
    ) == (True, 64, 512, "auto")


def test_check_rejects_a_max_seq_len_too_short():
    with pytest.raises(ValueError, match="--max-seq-len 10"):
        BenchSettings(prompt_len=8, new_tokens=8, max_seq_len=10).check()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_kv_bytes_per_position_counts_every_layers_keys_and_values(llama_path, kv_dtype):
    """metrics.kv_bytes_per_position: K and V of every KV head in every layer at their
    stored size, and an FP8 cache's two float32 scales a head (KVCache.position_bytes)."""
    from runtime.bench.metrics import kv_bytes_per_position
    from runtime.models import load_model
    from runtime.models.arch.cache import KVCache

    model = load_model(llama_path, torch.float32, torch.device("cpu"))
    model.allocate_cache(2, 64, kv_dtype=kv_dtype)
    args = model.args
    assert kv_bytes_per_position(model) == args.n_layers * KVCache.position_bytes(
        args.n_kv_heads, args.head_dim, torch.float32, kv_dtype
    )


# --- --device on this machine ----------------------------------------------------------------
def _bench_args(*argv: str) -> argparse.Namespace:
    args = _parse(*argv)
    args.quiet = False  # the parser of `tandem` adds it
    return args


@pytest.mark.parametrize(
    "device, tp, count, expected",
    [
        ("cuda:0", 1, 0, "no CUDA device"),
        ("cuda", 1, 0, "no CUDA device"),
        ("cuda:1", 1, 1, "needs cuda:1, but this machine has 1 CUDA device "),
        ("cuda:0", 3, 2, "--target-tp 3 needs cuda:2"),
        ("mps", 1, 1, "expected cuda:N or cpu"),
        ("gpu0", 1, 1, "expected cuda:N or cpu"),
    ],
)
def test_a_device_this_machine_lacks_is_refused(monkeypatch, device, tp, count, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=expected):
        BenchSettings(device=device, target_tp=tp).check()
    BenchSettings(device="cpu").check()
    if count:
        BenchSettings(device="cuda:0").check()


def test_bench_on_a_missing_gpu_is_a_usage_error_leaving_nothing(tmp_path, monkeypatch, capsys):
    """`tandem bench --device cuda:0` without a GPU: one line, exit 2, no temporary folder."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(_bench_args("--device", "cuda:0", "--modes", "target")) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: bench: --device cuda:0: this machine has no CUDA")
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_a_failure_after_the_synthetic_pair_is_built_removes_it(tmp_path, monkeypatch):
    """The pair's temporary folder goes however the run fails (here: selecting the GPU, which
    once failed outside the cleanup)."""
    from runtime.bench import runner

    def fail(*_):
        raise RuntimeError("cannot select the device")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", fail)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings = BenchSettings(device="cuda:0", modes=["spec"], prompt_len=8, new_tokens=8)
    with pytest.raises(RuntimeError, match="cannot select the device"):
        runner.Bench(settings).run()
    assert list(tmp_path.iterdir()) == []


def test_verification_flag_reaches_the_engine_config(tmp_path):
    """--verification sets speculation.verification and the `logits` acceptance it verifies;
    without it the synthetic pair keeps `tokens` acceptance and the token rule."""
    assert _parse("--synthetic", "tiny").verification is None
    assert _parse("--verification", "block").verification == "block"
    with pytest.raises(SystemExit):
        _parse("--verification", "blocks")
    spec = resolve(_synthetic(tmp_path)).engine_config["speculation"]
    assert (spec["acceptance"], spec.get("verification", "token")) == ("tokens", "token")
    config = resolve(_synthetic(tmp_path, verification="block")).engine_config
    assert config["speculation"] == {
        "draft_len": 4,
        "acceptance": "logits",
        "verification": "block",
    }
    cfg = load_config(config, check_devices=False).speculation
    assert (cfg.acceptance, cfg.verification) == ("logits", "block")
    with pytest.raises(ValueError, match="--verification"):
        BenchSettings(verification="both").check()
