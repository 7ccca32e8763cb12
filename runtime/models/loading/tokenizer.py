"""Tokenizer loading for a HF checkpoint dir or a .gguf file (the orchestrator's tokenizer).

The path is checked before transformers is imported (seconds), so a bad tokenizer path is
a fast, clear error."""

from __future__ import annotations

import os

__all__ = [
    "TOKENIZER_FILES",
    "has_tokenizer_files",
    "check_tokenizer_path",
    "load_tokenizer",
    "load_gguf_tokenizer",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """True if `path` is a .gguf file (the tokenizer is embedded) or a dir with tokenizer files."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return True
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES
    )


def check_tokenizer_path(path: str | os.PathLike, required: bool = True) -> bool:
    """Whether `path` holds a tokenizer. Raises FileNotFoundError for a missing path (or,
    when `required`, a dir without tokenizer files) and ValueError for a file that is not
    a .gguf file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if os.path.isfile(path) and not path.lower().endswith(".gguf"):
        raise ValueError(
            f"tokenizer path {path} is a file but not a .gguf file; "
            f"give a HF checkpoint/tokenizer dir or a .gguf file"
        )
    if has_tokenizer_files(path):
        return True
    if required:
        raise FileNotFoundError(
            f"tokenizer path {path} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    return False


def load_tokenizer(path: str | os.PathLike, required: bool = False):
    """A transformers tokenizer for a HF dir or a .gguf file; None for a dir without one
    (FileNotFoundError instead when `required`, e.g. a tokenizer path set explicitly).

    Raises FileNotFoundError for a missing path, ValueError for a file that is no .gguf."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not check_tokenizer_path(path, required):
        return None
    from transformers import AutoTokenizer

    if os.path.isfile(path):
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer embedded in a .gguf file. transformers builds it from the GGUF's
    vocabulary and merges (seconds); the result is saved once (save_pretrained:
    tokenizer.json, tokenizer_config.json, chat_template.jinja) in the GGUF cache
    (runtime.models.loading.gguf_cache) and read from there at every later start."""
    from transformers import AutoTokenizer

    from runtime.models.loading import gguf_cache

    path = os.fspath(path)
    return gguf_cache.cached(
        path,
        "tokenizer",
        make=lambda: AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        ),
        save=lambda tokenizer, tmp: tokenizer.save_pretrained(str(tmp)),
        load=lambda directory: AutoTokenizer.from_pretrained(str(directory)),
    )
