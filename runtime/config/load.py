"""load_config: a YAML file or a dict -> a validated, frozen TandemConfig, before any process
starts. See /work/shared/INTERFACE.md ("YAML config") for the schema."""

from __future__ import annotations

import os

from runtime.config import checks
from runtime.config.reader import read_yaml
from runtime.config.schema import TandemConfig, parse_config


def _read_source(source: str | os.PathLike | dict) -> tuple[dict, str]:
    """(raw mapping, base dir for relative paths)."""
    if isinstance(source, dict):
        return source, os.getcwd()
    if isinstance(source, (str, os.PathLike)):
        path = os.path.abspath(os.path.expanduser(os.fspath(source)))
        return read_yaml(path), os.path.dirname(path)
    raise TypeError(f"load_config: source must be a path or a dict, got {type(source).__name__}")


def load_config(
    source: str | os.PathLike | dict, *, check_files: bool = True, check_devices: bool = True
) -> TandemConfig:
    """Parse and validate a YAML file (relative paths resolve against its dir) or a dict
    (relative paths resolve against the cwd). Raises ConfigError naming the key.

    A model or tokenizer that is no existing path but reads `org/name[@revision]` is a
    Hugging Face id: with check_files it becomes its snapshot directory in the local HF cache
    (or a ConfigError when it is not cached and runtime.download is false); without
    check_files every value stays a path.

    With check_files, runtime.max_seq_len must fit the models' context; left out, it is the
    smaller of its default and that context. With check_devices too, KV caches that cannot
    fit a CUDA device's free memory are an error (runtime.config.checks.check_kv_memory)."""
    raw, base = _read_source(source)
    cfg = parse_config(raw, base, resolve_ids=check_files)
    checks.check_backend(cfg)
    if check_devices:
        checks.check_cuda(cfg)
    checks.check_server_auth(cfg.server, check_files)
    if check_files:
        checks.check_files(cfg)
        runtime = raw.get("runtime")
        cfg = checks.fit_context(cfg, isinstance(runtime, dict) and "max_seq_len" in runtime)
        if check_devices:
            checks.check_kv_memory(cfg)
    return cfg
