"""Checkpoint metadata: what a HF checkpoint dir or a GGUF file holds, without loading weights.

`inspect_checkpoint(path)` reads `config.json` (+ `generation_config.json`) of a HF dir, or the
metadata of a `.gguf` file through the `gguf` package's GGUFReader. GGUF results are cached per
(path, size, mtime), because GGUFReader parses the whole tokenizer vocabulary (seconds).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointInfo", "inspect_checkpoint", "is_gguf_path"]


@dataclass(frozen=True)
class CheckpointInfo:
    path: str  # absolute path of the HF dir or the .gguf file
    format: str  # 'hf' | 'gguf'
    vocab_size: int
    architecture: str  # HF: architectures[0], e.g. 'LlamaForCausalLM'; GGUF: 'llama'
    model_type: str  # 'llama', 'qwen2', 'mistral', ...
    eos_token_ids: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    hidden_size: int
    # what the runtime's config checks need (None: the checkpoint does not say)
    head_dim: int | None = None  # per attention head (K and V)
    max_position_embeddings: int | None = None  # the context it was trained for


def is_gguf_path(path: str | os.PathLike) -> bool:
    """True for a path that names a GGUF file (by its extension)."""
    return os.fspath(path).lower().endswith(".gguf")


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Metadata of a HF checkpoint dir (with config.json) or a .gguf file; never loads weights.

    Raises FileNotFoundError for a missing path or a dir without config.json, ValueError for a
    file that cannot be read as a checkpoint. Every message names the path."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(
                f"checkpoint dir {path} has no config.json (expected a HF checkpoint dir "
                f"with config.json + safetensors, or a .gguf file)"
            )
        return _inspect_hf(path)
    stat = os.stat(path)
    return _inspect_gguf_cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _inspect_gguf_cached(path: str, size: int, mtime_ns: int) -> CheckpointInfo:
    """_inspect_gguf's result, also kept on disk (runtime.models.loading.gguf_cache): later starts
    skip the GGUFReader parse."""
    from dataclasses import asdict

    from runtime.models.loading import gguf_cache

    info = gguf_cache.load_info(path, lambda: asdict(_inspect_gguf(path, size, mtime_ns)))
    return CheckpointInfo(**dict(info, path=path, eos_token_ids=tuple(info["eos_token_ids"])))


# --------------------------------------------------------------------------- HF


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"cannot read {path}: top level is {type(data).__name__}, not an object")
    return data


def _eos_tuple(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    return None


def _hf_get(config: dict, key: str, default: Any = None) -> Any:
    """config[key], falling back to a nested text_config (multimodal wrappers)."""
    if key in config and config[key] is not None:
        return config[key]
    text = config.get("text_config")
    if isinstance(text, dict) and text.get(key) is not None:
        return text[key]
    return default


def _hf_int(config: dict, key: str, path: str, default: int | None = None) -> int:
    value = _hf_get(config, key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"checkpoint {path}: config.json has no integer {key!r} (got {value!r})")
    return value


def _inspect_hf(path: str) -> CheckpointInfo:
    config = _read_json(os.path.join(path, "config.json"))
    eos = None
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        eos = _eos_tuple(_read_json(gen_file).get("eos_token_id"))
    if eos is None:
        eos = _eos_tuple(_hf_get(config, "eos_token_id")) or ()
    model_type = _hf_get(config, "model_type", "")
    archs = config.get("architectures") or []
    architecture = archs[0] if archs and isinstance(archs[0], str) else str(model_type)
    vocab = _hf_int(config, "vocab_size", path)
    heads = _hf_int(config, "num_attention_heads", path)
    hidden = _hf_int(config, "hidden_size", path)
    return CheckpointInfo(
        path=path,
        format="hf",
        vocab_size=vocab,
        architecture=architecture,
        model_type=str(model_type),
        eos_token_ids=eos,
        num_attention_heads=heads,
        num_key_value_heads=_hf_int(config, "num_key_value_heads", path, heads),
        num_hidden_layers=_hf_int(config, "num_hidden_layers", path),
        hidden_size=hidden,
        head_dim=_optional_int(_hf_get(config, "head_dim")) or hidden // heads,
        max_position_embeddings=_optional_int(_hf_get(config, "max_position_embeddings")),
    )


def _optional_int(value: Any) -> int | None:
    """A positive int, else None (absent or not an integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


# --------------------------------------------------------------------------- GGUF


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return value[0]  # per-layer arrays (e.g. head counts): first layer's value
    return value


def _gguf_vocab(reader: Any, arch: str) -> int | None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) > 0:
        return len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dims fastest-first: [hidden, vocab]
    value = _gguf_value(reader, f"{arch}.vocab_size")
    return int(value) if value is not None else None


def _open_gguf(path: str) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ValueError(f"cannot read {path}: the 'gguf' package is not installed") from e
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct errors, OSError, ...
        raise ValueError(
            f"cannot read {path} as a GGUF file "
            f"(nor is it a HF checkpoint dir): {type(e).__name__}: {e}"
        ) from e


@functools.lru_cache(maxsize=16)
def _inspect_gguf(path: str, _size: int, _mtime_ns: int) -> CheckpointInfo:
    reader = _open_gguf(path)
    arch = _gguf_value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"GGUF file {path} has no general.architecture")

    def need_int(key: str, default: int | None = None) -> int:
        value = _gguf_value(reader, key)
        if value is None:
            value = default
        if value is None:
            raise ValueError(f"GGUF file {path} has no {key}")
        return int(value)

    vocab = _gguf_vocab(reader, arch)
    if vocab is None:
        raise ValueError(
            f"GGUF file {path}: cannot tell the vocab size "
            f"(no tokenizer.ggml.tokens, token_embd.weight or {arch}.vocab_size)"
        )
    eos = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    heads = need_int(f"{arch}.attention.head_count")
    hidden = need_int(f"{arch}.embedding_length")
    key_length, context = (
        _gguf_value(reader, f"{arch}.{name}") for name in ("attention.key_length", "context_length")
    )
    return CheckpointInfo(
        path=path,
        format="gguf",
        vocab_size=vocab,
        architecture=arch,
        model_type=arch,
        eos_token_ids=(int(eos),) if eos is not None else (),
        num_attention_heads=heads,
        num_key_value_heads=need_int(f"{arch}.attention.head_count_kv", heads),
        num_hidden_layers=need_int(f"{arch}.block_count"),
        hidden_size=hidden,
        head_dim=int(key_length) if key_length is not None else hidden // heads,
        max_position_embeddings=int(context) if context is not None else None,
    )
