"""Hugging Face model ids in the config (`org/name[@revision]`): resolved in a local HF cache
that each test builds itself (models--org--name/snapshots/<commit>/ + refs/<branch>, the
layout huggingface_hub reads); nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import yaml

from runtime.config import ConfigError, load_config
from tests.checkpoints import build_checkpoint

pytestmark = pytest.mark.timeout(120)

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return Path(build_checkpoint(tmp_path_factory.mktemp("ids") / "llama", seed=1))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty HF hub cache, named by HF_HUB_CACHE (for child processes) and set on the
    already imported huggingface_hub (which reads the variable once, at import)."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return root


def put(cache: Path, repo_id: str, commit: str, source: Path, refs=("main",)) -> Path:
    """Store `source`'s files as snapshot `commit` of `repo_id`, with `refs` pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for item in source.iterdir():
        (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def tokenizer_dir(root: Path) -> Path:
    """A real (tiny, word-level) tokenizer saved as tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    root.mkdir()
    Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(
        str(root / "tokenizer.json")
    )
    return root


def config(target: str, draft: str | None = None, **extra) -> dict:
    return {
        "draft": {"model": draft or target, "devices": ["cpu:0"], "dtype": "float32"},
        "target": {"model": target, "devices": ["cpu:1"], "dtype": "float32"},
        **extra,
    }


def load(cfg, **kwargs):
    return load_config(cfg, check_devices=False, **kwargs)


def test_cached_id_resolves_to_its_snapshot(cache, checkpoint):
    snapshot = put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    cfg = load(config("org/tiny-llama"))
    assert cfg.target.model == cfg.draft.model == str(snapshot)
    assert cfg.tokenizer_path == str(snapshot)


def test_revisions_commit_and_branch(cache, checkpoint, tmp_path):
    first = put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    second = put(cache, "org/tiny-llama", COMMIT_B, checkpoint, refs=("dev",))
    assert load(config("org/tiny-llama")).target.model == str(first)  # refs/main
    assert load(config("org/tiny-llama@dev")).target.model == str(second)
    assert load(config(f"org/tiny-llama@{COMMIT_B}")).target.model == str(second)
    assert load(config("org/tiny-llama@main", draft="org/tiny-llama@dev")).draft.model == str(
        second
    )
    with pytest.raises(ConfigError) as info:
        load(config("org/tiny-llama@nope", draft="org/tiny-llama"))
    assert info.value.key == "target.model"
    assert "org/tiny-llama@nope" in str(info.value) and "--revision nope" in str(info.value)
    with pytest.raises(ConfigError, match="target.model: .*empty revision"):
        load(config("org/tiny-llama@", draft="org/tiny-llama"))


def test_uncached_id_is_a_config_error_naming_key_id_and_cache(cache, checkpoint):
    put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    with pytest.raises(ConfigError) as info:
        load(config("meta-llama/Llama-3.1-8B-Instruct", draft="org/tiny-llama"))
    err = info.value
    assert err.key == "target.model" and str(err).startswith("target.model: ")
    for fragment in (
        "meta-llama/Llama-3.1-8B-Instruct",
        str(cache),
        "runtime.download",
        "not in the local cache",
    ):
        assert fragment in str(err), str(err)


def test_tokenizer_id(cache, checkpoint, tmp_path):
    put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    tok = put(cache, "org/tok", COMMIT_B, tokenizer_dir(tmp_path / "tok"))
    assert load(config("org/tiny-llama", tokenizer="org/tok")).tokenizer == str(tok)
    with pytest.raises(ConfigError, match="^tokenizer: Hugging Face model org/other"):
        load(config("org/tiny-llama", tokenizer="org/other"))


def test_existing_path_wins_over_a_cached_id(cache, checkpoint, tmp_path, monkeypatch):
    put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    local = tmp_path / "org" / "tiny-llama"
    local.parent.mkdir()
    local.symlink_to(checkpoint, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert load(config("org/tiny-llama")).target.model == str(local)


@pytest.mark.parametrize(
    "value", ["models/a/b", "../missing", "./org/name", "~/org/name", "org--x/name", "/abs/org"]
)
def test_other_missing_values_stay_paths(cache, checkpoint, value):
    with pytest.raises(ConfigError) as info:
        load(config(value, draft=str(checkpoint)))
    assert info.value.key == "target.model"
    assert "does not exist" in str(info.value) and "Hugging Face" not in str(info.value)


def test_without_check_files_ids_stay_paths(cache, checkpoint, tmp_path, monkeypatch):
    """Workers re-read the config the orchestrator resolved: no cache lookup there."""
    put(cache, "org/tiny-llama", COMMIT_A, checkpoint)
    monkeypatch.chdir(tmp_path)
    cfg = load(config("org/tiny-llama"), check_files=False)
    assert cfg.target.model == str(tmp_path / "org" / "tiny-llama")


def test_round_trip_keeps_the_resolved_directory(cache, checkpoint):
    put(cache, "org/tiny-llama", COMMIT_A, checkpoint, refs=("main", "dev"))
    cfg = load(config("org/tiny-llama@dev", runtime={"download": False}))
    assert load(cfg.to_dict(), check_files=False) == cfg
    assert load(cfg.to_dict()) == cfg
    assert cfg.to_dict()["runtime"]["download"] is False


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "true"])
def test_download_is_type_checked(value):
    with pytest.raises(ConfigError) as info:
        load(config("/models/t", runtime={"download": value}), check_files=False)
    assert info.value.key == "runtime.download"
    assert "true or false" in str(info.value)
    assert load(config("/m"), check_files=False).runtime.download is False
    assert load(config("/m", runtime={"download": True}), check_files=False).runtime.download


def test_download_failure_names_the_key(cache, checkpoint, monkeypatch):
    """runtime.download: true asks the Hub (here an endpoint nothing listens at) only for a
    model that is not cached; the failure is a ConfigError naming the key."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as info:
        load(config("org/not-cached", draft=str(checkpoint), runtime={"download": True}))
    assert info.value.key == "target.model"
    assert "org/not-cached" in str(info.value) and "downloading it failed" in str(info.value)


def test_cli_uncached_id_exits_2_before_any_process(cache, checkpoint, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        yaml.safe_dump(config("meta-llama/Llama-3.1-8B-Instruct", draft=str(checkpoint)))
    )
    env = dict(os.environ, HF_HUB_CACHE=str(cache), PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "run", str(path), "--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert (
        "tandem: error: target.model: Hugging Face model meta-llama/Llama-3.1-8B-Instruct "
        "is not in the local cache" in res.stderr
    ), res.stderr
    assert str(cache) in res.stderr
