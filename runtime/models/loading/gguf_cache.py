"""On-disk cache of what a .gguf file costs to convert at every start.

Reading a GGUF is slow where it least looks it: every parse of its metadata walks the whole
tokenizer vocabulary (seconds for SmolLM2's 49k tokens), and transformers, the gguf package and
our own metadata check each parse it again; building the fast tokenizer from it takes longer
still. So the first start converts once and stores the results; later starts (the orchestrator
and every worker) read them in milliseconds:

- `config/`    transformers' config (save_pretrained), for load_config;
- `tokenizer/` the converted tokenizer (save_pretrained: tokenizer.json, ...);
- `info/`      the checkpoint metadata of runtime.models.loading.checkpoint;
- `weights-<key>/` the tensors exactly as GGUFWeights hands them out (dequantized by the gguf
  package, llama.cpp's q/k permutation undone by transformers' tensor processor), as
  safetensors; <key> hashes the model's parameter names and the config they were mapped with.

The cache lives under runtime.models.loading.disk_cache's root, an entry at
gguf/<sha256 of the file>/<converter tag>/, so a changed file, or another version of
transformers or gguf (which do the converting), never meets an old entry. The sha256 of a file
is computed once and remembered under digests/ by the file's identity (path, device, inode,
size, mtime, ctime): a file rewritten in place is hashed again. Entries are published
atomically (disk_cache.publish); an entry whose files do not match its manifest, or that fails
to load, is thrown away and rebuilt. A cache that cannot be written (read-only, disk full)
costs only a warning: the GGUF is read directly, as without the cache. Dequantized weights larger
than
$TANDEM_CACHE_MAX_GB (default 16; 0 turns the weights cache off) are not cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from runtime.models.loading import portable_config
from runtime.models.loading.disk_cache import (
    cache_root,
    discard,
    is_complete,
    publish,
    write_atomic,
)

log = logging.getLogger("tandem.cache")

MAX_GB_ENV = "TANDEM_CACHE_MAX_GB"
DEFAULT_MAX_GB = 16.0
FORMAT = 1  # of our entries; a change makes a new converter tag
PART_BYTES = 1 << 30  # weights are written in safetensors files of about this size

T = TypeVar("T")


# --- keys --------------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file's bytes, computed once per file identity and remembered in the
    cache (hashing the demo's 98 MB takes a fraction of a second; a 4 GB file, seconds)."""
    path = os.path.realpath(path)
    st = os.stat(path)
    identity = f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    memo = cache_root() / "digests" / hashlib.sha256(identity.encode()).hexdigest()
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    except OSError:
        pass
    digest = _sha256(path)
    try:
        write_atomic(memo, digest.encode())
    except OSError as exc:
        log.warning("cannot remember the sha256 of %s in %s: %s", path, memo.parent, exc)
    return digest


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        if hasattr(hashlib, "file_digest"):  # Python 3.11+
            return hashlib.file_digest(fh, "sha256").hexdigest()
        digest = hashlib.sha256()
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        return digest.hexdigest()


def converter_tag() -> str:
    """What converts a GGUF: our entry format and the versions of transformers and gguf."""
    from importlib import metadata

    return (
        f"v{FORMAT}-transformers-{metadata.version('transformers')}-gguf-{metadata.version('gguf')}"
    )


def entry_dir(gguf_path: str | os.PathLike) -> Path:
    """The cache directory of one GGUF file's conversions (not created here)."""
    return cache_root() / "gguf" / file_sha256(gguf_path) / converter_tag()


def weights_key(config: Any, param_names: Iterable[str]) -> str:
    """Which tensors a GGUFWeights hands out depends on the model's parameter names (the
    name map) and the config (the tensor processor): both go into the weights' key."""
    settings = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    text = json.dumps(
        {"names": sorted(param_names), "config": settings}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class NotCached(Exception):
    """Raised by a save function: this one is not worth caching (logged, not warned)."""


def cached(
    gguf_path: str | os.PathLike,
    name: str,
    make: Callable[[], T],
    save: Callable[[T, Path], object],  # what it returns is ignored
    load: Callable[[Path], T],
) -> T:
    """`load(entry/name)` when the cache holds it; else `make()` (from the GGUF; its errors
    are the caller's), `save` it into a new entry and load that (closing what make() gave,
    if it can be closed). A broken entry is rebuilt; a cache that cannot be used gives
    make()'s result, with a warning."""
    try:
        target = entry_dir(gguf_path) / name
    except OSError as exc:
        log.warning("cache unusable (%s): reading %s directly", exc, gguf_path)
        return make()
    if is_complete(target):
        try:
            return load(target)
        except Exception as exc:  # noqa: BLE001 - whatever a broken entry raises: rebuild
            log.warning(
                "cache entry %s is broken (%s: %s); rebuilding it", target, type(exc).__name__, exc
            )
            discard(target)
    made = make()
    try:
        publish(target, lambda tmp: save(made, tmp))
    except NotCached as why:
        log.info("%s of %s not cached: %s", name, gguf_path, why)
        return made
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: never fatal
        log.warning(
            "cannot cache %s of %s in %s: %s: %s",
            name,
            gguf_path,
            target.parent,
            type(exc).__name__,
            exc,
        )
        return made
    try:
        result = load(target)
    except Exception as exc:  # noqa: BLE001 - never left for the next start to load
        log.warning(
            "the new cache entry %s is broken (%s: %s); removed", target, type(exc).__name__, exc
        )
        discard(target)
        return made
    if hasattr(made, "close"):
        made.close()
    return result


# --- what is cached ----------------------------------------------------------------------
def load_config(gguf_path: str | os.PathLike) -> Any:
    """transformers' config of a .gguf file (AutoConfig, gguf_file=...), cached; from the
    cache as a PortableConfig (no transformers import) when our model runs it."""
    gguf_path = Path(gguf_path)
    directory = str(gguf_path.parent)

    def make():
        import transformers

        return transformers.AutoConfig.from_pretrained(directory, gguf_file=gguf_path.name)

    def save(cfg, tmp: Path) -> None:
        cfg.save_pretrained(tmp)
        portable_config.write(cfg, tmp)

    def load(d: Path):
        import transformers

        return portable_config.read(d) or transformers.AutoConfig.from_pretrained(str(d))

    config = cached(gguf_path, "config", make, save, load)
    config._name_or_path = directory  # as read from the GGUF, not from the cache
    return config


def load_info(gguf_path: str | os.PathLike, make: Callable[[], dict]) -> dict:
    """The checkpoint metadata dict `make()` reads from a .gguf file, cached as JSON."""
    return cached(
        gguf_path,
        "info",
        make,
        save=lambda info, tmp: (tmp / "info.json").write_text(json.dumps(info)),
        load=lambda d: json.loads((d / "info.json").read_text()),
    )


def _max_bytes() -> float:
    text = os.environ.get(MAX_GB_ENV, "")
    try:
        return float(text) * 1e9 if text else DEFAULT_MAX_GB * 1e9
    except ValueError:
        raise ValueError(f"{MAX_GB_ENV}={text!r}: expected a number of GB") from None


def _save_weights(source: Any, tmp: Path) -> None:
    """Every tensor of `source` (GGUFWeights.get: float32, processed) into safetensors
    files of about PART_BYTES, with the index SafetensorsWeights reads; fsynced, as an
    entry cut short by a crash could otherwise keep its size and lose its bytes."""
    from safetensors.torch import save_file

    from runtime.models.loading.weights import INDEX_FILE

    weight_map: dict[str, str] = {}
    part: dict = {}

    def flush() -> None:
        file = tmp / f"part-{len(set(weight_map.values())):05d}.safetensors"
        save_file(part, str(file), metadata={"format": "pt"})
        with open(file, "rb") as fh:
            os.fsync(fh.fileno())
        weight_map.update(dict.fromkeys(part, file.name))
        part.clear()

    size = 0
    for name in sorted(source.names()):
        tensor = source.get(name).contiguous()
        part[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= PART_BYTES:
            flush()
            size = 0
    if part:
        flush()
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def open_weights(gguf_path: str | os.PathLike, config: Any, param_names: Iterable[str]):
    """A weight source for the model's tensors in a .gguf file: the cached safetensors copy
    (SafetensorsWeights: read lazily, a tensor-parallel shard without the rest) when there
    is one, else the GGUF is converted into the cache first. Bigger than
    TANDEM_CACHE_MAX_GB, or with no usable cache: GGUFWeights straight from the file."""
    from runtime.models.loading.weights import GGUFWeights, SafetensorsWeights

    param_names = list(param_names)
    limit = _max_bytes()
    if limit <= 0:
        return GGUFWeights(gguf_path, config, param_names)
    expected: set[str] = set()  # known on a miss only: a hit never opens the GGUF

    def make():
        source = GGUFWeights(gguf_path, config, param_names)
        expected.update(source.names())
        return source

    def save(source, tmp: Path) -> None:
        if source.dequantized_nbytes() > limit:
            raise NotCached(f"its dequantized weights exceed {MAX_GB_ENV}={limit / 1e9:g} GB")
        _save_weights(source, tmp)

    def load(directory: Path):
        source = SafetensorsWeights(directory)
        if expected and source.names() != expected:
            raise ValueError("its tensors are not the GGUF's")
        return source

    return cached(gguf_path, f"weights-{weights_key(config, param_names)}", make, save, load)
