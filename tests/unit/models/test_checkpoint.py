"""runtime.models.loading.checkpoint (metadata only) and runtime.models.loading.tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models.loading.checkpoint import CheckpointInfo, inspect_checkpoint
from runtime.models.loading.tokenizer import load_tokenizer
from tests.checkpoints import build_checkpoint, smollm2_gguf

pytestmark = pytest.mark.timeout(60)


def test_hf_llama(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    info = inspect_checkpoint(path)
    assert info == CheckpointInfo(
        path=os.path.abspath(path),
        format="hf",
        vocab_size=96,
        architecture="LlamaForCausalLM",
        model_type="llama",
        eos_token_ids=(2,),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        hidden_size=64,
        head_dim=16,
        max_position_embeddings=512,
    )


def test_hf_qwen2(tmp_path):
    info = inspect_checkpoint(
        build_checkpoint(tmp_path / "qwen", arch="qwen2", vocab_size=120, num_hidden_layers=3)
    )
    assert (info.format, info.architecture, info.model_type) == ("hf", "Qwen2ForCausalLM", "qwen2")
    assert (info.vocab_size, info.num_hidden_layers) == (120, 3)


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_hf_eos_from_generation_config(tmp_path):
    path = tmp_path / "m"
    build_checkpoint(path)
    _edit_json(path / "generation_config.json", eos_token_id=[2, 7])
    assert inspect_checkpoint(str(path)).eos_token_ids == (2, 7)
    _edit_json(path / "generation_config.json", eos_token_id=5)
    assert inspect_checkpoint(str(path)).eos_token_ids == (5,)


def test_hf_eos_falls_back_to_config(tmp_path):
    path = tmp_path / "m"
    build_checkpoint(path, eos_token_id=9)
    (path / "generation_config.json").unlink()
    assert inspect_checkpoint(str(path)).eos_token_ids == (9,)
    _edit_json(path / "config.json", eos_token_id=[3, 4])
    assert inspect_checkpoint(str(path)).eos_token_ids == (3, 4)


def test_hf_kv_heads_default_to_heads(tmp_path):
    path = tmp_path / "m"
    build_checkpoint(path)
    data = json.loads((path / "config.json").read_text())
    del data["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(data))
    assert inspect_checkpoint(str(path)).num_key_value_heads == 4


def test_gguf_smollm2():
    path = smollm2_gguf()
    info = inspect_checkpoint(path)
    assert info.format == "gguf" and info.path == os.path.abspath(path)
    assert info.vocab_size == 49152
    assert info.num_hidden_layers == 30
    assert info.model_type == "llama" and info.architecture == "llama"
    assert (info.num_attention_heads, info.num_key_value_heads, info.hidden_size) == (9, 3, 576)
    assert info.eos_token_ids == (2,)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        inspect_checkpoint(str(tmp_path / "nothing-here"))


def test_dir_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json") as info:
        inspect_checkpoint(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00"])
def test_unreadable_file(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        inspect_checkpoint(str(path))
    assert str(path) in str(info.value)


def test_bad_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        inspect_checkpoint(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="vocab_size"):
        inspect_checkpoint(str(tmp_path / "m"))


def test_tokenizer_gguf_round_trip():
    tok = load_tokenizer(smollm2_gguf())
    assert tok is not None
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token_id == 2


def test_tokenizer_none_without_files(tmp_path):
    assert load_tokenizer(build_checkpoint(tmp_path / "m")) is None


def test_tokenizer_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))


def test_bad_tokenizer_path_fails_before_transformers_loads(tmp_path):
    """A missing path, a file that is no .gguf, or (when a tokenizer is required) a dir
    without tokenizer files: a clear error before the slow transformers import."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "vocab.txt").write_text("a b c")
    code = f"""
import sys
from pathlib import Path
from runtime.models.loading.tokenizer import load_tokenizer
cases = [({str(tmp_path / "nope")!r}, False, FileNotFoundError, "does not exist"),
         ({str(tmp_path / "vocab.txt")!r}, False, ValueError, "not a .gguf file"),
         ({str(tmp_path / "empty")!r}, True, FileNotFoundError, "no tokenizer files")]
for path, required, error, words in cases:
    try:
        load_tokenizer(path, required=required)
    except error as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(path)
assert load_tokenizer({str(tmp_path / "empty")!r}) is None
assert "transformers" not in sys.modules
"""
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    assert res.returncode == 0, res.stderr[-2000:]
