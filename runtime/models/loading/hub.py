"""Hugging Face model ids in the config: `org/name[@revision]` -> a local snapshot directory.

The id resolves the way transformers and vLLM resolve it, through huggingface_hub's own
cache (HF_HOME / HF_HUB_CACHE, read by huggingface_hub when it is imported): a revision may
be a branch or tag (read from the cache's refs/) or a commit hash. Nothing is downloaded
unless the config allows it (`runtime.download: true`); then only what a checkpoint and its
tokenizer need is fetched (no `original/` consolidated weights, no .bin duplicates).
Workers receive the snapshot directory, never the id.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import ConfigError

# what a checkpoint directory (config.json + safetensors) and its tokenizer need
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
]
IGNORE_PATTERNS = ["original/*"]


@dataclass(frozen=True)
class ModelId:
    repo_id: str  # org/name
    revision: str | None  # branch, tag or commit hash; None = main

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_model_id(text: str, key: str) -> ModelId | None:
    """The id in `text` if it has the shape of a Hub model id (`org/name`, optionally
    `@revision`), else None (then it is a path). Shape only: the cache is not consulted."""
    repo_id, at, revision = text.strip().partition("@")
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None  # cheap test first: most paths never import huggingface_hub
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    if at and not revision:
        raise ConfigError(
            key,
            f"{text!r}: empty revision after '@' (write org/name@revision, "
            f"e.g. @main or @<commit hash>)",
        )
    return ModelId(repo_id, revision or None)


def cache_dir() -> str:
    """The Hugging Face hub cache that ids resolve in (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve(model_id: ModelId, key: str, *, download: bool, path: str) -> str:
    """The local snapshot directory of `model_id`; downloads it first when `download` and it
    is not cached. ConfigError naming `key`, the id and the cache otherwise (`path` is what
    the value would have meant as a path: it does not exist)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            model_id.repo_id, revision=model_id.revision, local_files_only=True
        )
    except LocalEntryNotFoundError:
        pass
    if not download:
        revision = f" --revision {model_id.revision}" if model_id.revision else ""
        raise ConfigError(
            key,
            f"Hugging Face model {model_id} is not in the local cache "
            f"{cache_dir()} (set HF_HUB_CACHE or HF_HOME to use another), "
            f"and no path {path} exists; download it with `hf download "
            f"{model_id.repo_id}{revision}`, or set runtime.download: true",
        )
    try:
        return snapshot_download(
            model_id.repo_id,
            revision=model_id.revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except Exception as exc:  # noqa: BLE001 - network, auth, missing repo: all name the key
        raise ConfigError(
            key,
            f"Hugging Face model {model_id} is not in the local cache "
            f"{cache_dir()} and downloading it failed: "
            f"{type(exc).__name__}: {exc}",
        ) from None
