"""Tokenizer loading for a HF checkpoint dir or a .gguf file (the orchestrator's tokenizer)."""
from __future__ import annotations

import os

__all__ = ["TOKENIZER_FILES", "has_tokenizer_files", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """True if `path` is a .gguf file (the tokenizer is embedded) or a dir with tokenizer files."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return True
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer for a HF dir or a .gguf file; None for a dir without one.

    Raises FileNotFoundError for a missing path."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    from transformers import AutoTokenizer

    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"tokenizer path {path} is a file but not a .gguf file; "
                             f"give a HF checkpoint/tokenizer dir or a .gguf file")
        return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path))
    if not has_tokenizer_files(path):
        return None
    return AutoTokenizer.from_pretrained(path)
