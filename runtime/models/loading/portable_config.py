"""A checkpoint's transformers config kept on disk as plain JSON, so that later starts read it
without importing transformers.

Reading a config through transformers (AutoConfig) costs about 2 s of CPU, nearly all of it
importing transformers itself, in every rank of every launch. A config our Llama-family model
runs with plain RoPE needs nothing of transformers but the values: the first read stores the
config's complete `to_dict()` (every field with transformers' defaults filled in), and later
reads rebuild it as a `PortableConfig` (attribute access and `to_dict()`, all that
runtime.models.arch.model_args, rope, parallelize and the GGUF cache key read). Configs of other
RoPE types, and of models on the transformers fallback, are always read by transformers
(its RoPE initialisers and models take the real object).

An HF directory's entry lives at configs/<key>/ in runtime.models.loading.disk_cache's cache root,
the key hashing the bytes of config.json and the version of transformers (whose defaults it
holds), written atomically with disk_cache's `publish`; a .gguf file's converted config
carries its portable copy in its own cache entry (gguf_cache.load_config). A cache that
cannot be written costs nothing but the time saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.models.loading import disk_cache

log = logging.getLogger("tandem.cache")
FILE = "portable_config.json"
FORMAT = 1


class PortableConfig(SimpleNamespace):
    """A transformers config rebuilt from its to_dict(): the same attributes and the same
    to_dict(), without transformers."""

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", {})
        for key, value in values.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)
        self._values[key] = value

    def to_dict(self) -> dict:
        return dict(self._values)

    def __reduce__(self):  # copy.deepcopy (a draft that copies the target's model), pickle
        return PortableConfig, (self.to_dict(),)

    @property
    def name_or_path(self) -> str:
        return self._values.get("_name_or_path", "")


def is_portable(config: Any) -> bool:
    """Whether our model can run `config` from its values alone: a supported Llama-family
    config with plain RoPE."""
    from runtime.models.arch.model_args import rope_layer_types, rope_parameters, unsupported_reason

    return unsupported_reason(config) is None and all(
        rope_parameters(config, t)["rope_type"] == "default"
        for t in rope_layer_types(config) or (None,)
    )


def write(config: Any, directory: Path) -> None:
    """Store `config`'s values as directory/FILE, if it is portable."""
    if is_portable(config):
        (directory / FILE).write_text(json.dumps(config.to_dict(), default=str))


def read(directory: Path) -> PortableConfig | None:
    """The PortableConfig stored in `directory`, or None when there is none."""
    file = directory / FILE
    if not file.is_file():
        return None
    values = json.loads(file.read_text())
    if isinstance(values.get("id2label"), dict):  # JSON keys are strings; transformers' ints
        values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
    return PortableConfig(values)


def load_hf(directory: Path, load: Callable[[], Any]) -> Any:
    """The config of the HF checkpoint `directory`: from the cache when it holds it, else
    `load()` (transformers), stored for the next start when portable."""
    try:
        target = disk_cache.cache_root() / "configs" / _key(directory)
    except OSError:
        return load()
    if disk_cache.is_complete(target):
        try:
            config = read(target)
            if config is not None:
                config._name_or_path = str(directory)  # as AutoConfig reads it from here
                return config
        except (OSError, ValueError) as exc:
            log.warning("config cache entry %s is broken (%s); rebuilding it", target, exc)
        disk_cache.discard(target)
    config = load()
    if is_portable(config):
        try:
            disk_cache.publish(target, lambda tmp: write(config, tmp))
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: never fatal
            log.warning("cannot cache the config of %s in %s: %s", directory, target, exc)
    return config


def _key(directory: Path) -> str:
    text = (directory / "config.json").read_bytes()
    version = f"v{FORMAT}-transformers-{metadata.version('transformers')}".encode()
    return hashlib.sha256(version + b"\0" + text).hexdigest()[:32]
