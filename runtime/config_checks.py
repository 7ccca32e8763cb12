"""Checks of a parsed TandemConfig that look beyond its own values: one backend per run,
CUDA devices that exist, model files (vocabularies, TP head shapes) and server
authentication. Each raises ConfigError naming the key."""
from __future__ import annotations

import os

from runtime.config import ConfigError, Device, ModelConfig, ServerConfig, TandemConfig


def model_lists(cfg: TandemConfig) -> tuple[tuple[str, ModelConfig], ...]:
    return (("draft", cfg.draft), ("target", cfg.target))


def all_devices(cfg: TandemConfig) -> list[tuple[str, Device]]:
    """(list key, device) for every device, draft.devices first."""
    return [(f"{name}.devices", d) for name, model in model_lists(cfg) for d in model.devices]


def check_backend(cfg: TandemConfig) -> None:
    pairs = all_devices(cfg)
    first_key, first = pairs[0]
    for key, device in pairs:
        if device.kind != first.kind:
            raise ConfigError(key, f"mixes {device.kind} and {first.kind} devices ({device} "
                                   f"here, {first} in {first_key}); one backend per run: use "
                                   f"only CUDA indices or only cpu:N slots in draft.devices "
                                   f"and target.devices")


def check_cuda(cfg: TandemConfig) -> None:
    cuda = [(key, d) for key, d in all_devices(cfg) if d.kind == "cuda"]
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count()
    for key, device in cuda:
        if device.index >= count:
            raise ConfigError(key, f"device {device} does not exist: {count} CUDA device(s) "
                                   f"visible (torch.cuda.device_count() == {count}); "
                                   f"for CPU use cpu:N")


def check_files(cfg: TandemConfig) -> None:
    from runtime.models.checkpoint import inspect_checkpoint
    from runtime.serving.tokenizer import check_tokenizer_path

    for name, model in model_lists(cfg):
        if not os.path.exists(model.model):
            raise ConfigError(f"{name}.model", f"{model.model} does not exist")
    if cfg.tokenizer is not None:
        if not os.path.exists(cfg.tokenizer):
            raise ConfigError("tokenizer", f"{cfg.tokenizer} does not exist")
        try:
            check_tokenizer_path(cfg.tokenizer)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("tokenizer", str(exc)) from None
    infos = {}
    for name, model in model_lists(cfg):
        try:
            infos[name] = inspect_checkpoint(model.model)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{name}.model", str(e)) from e
    draft, target = infos["draft"], infos["target"]
    check_tp(cfg, infos)
    check_quantization(cfg, infos)
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            "draft.model",
            f"vocab mismatch: draft {draft.path} has vocab_size {draft.vocab_size} but "
            f"target {target.path} has vocab_size {target.vocab_size}; draft and target "
            f"must share one vocabulary")


def check_server_auth(server: ServerConfig, check_files: bool) -> None:
    from runtime.control import auth

    if server.auth_key_file is None:
        if not auth.is_loopback(server.address):
            raise ConfigError("server.address", f"{server.address} listens beyond loopback; "
                              "that requires server.auth_key_file (a shared secret)")
        return
    if check_files:
        try:
            auth.load_key(server.auth_key_file)
        except auth.AuthError as exc:
            raise ConfigError("server.auth_key_file", str(exc)) from None


def check_quantization(cfg: TandemConfig, infos: dict) -> None:
    """`<model>.quantization: fp8` needs tandem's Llama-family implementation (the
    transformers fallback cannot quantize), and a checkpoint's own quantization_config must be
    a format tandem runs (runtime.models.fp8_formats)."""
    from runtime.models.fp8_formats import read_format

    for name, model in model_lists(cfg):
        try:
            fmt = read_format(model.model)
        except ValueError as exc:
            fmt = exc
        if model.quantization is None and fmt is None:
            continue
        reason = _fallback_reason(model.model, infos[name])
        if reason is not None and model.quantization is not None:
            raise ConfigError(f"{name}.quantization", f"{model.quantization} needs tandem's "
                              f"Llama-family implementation, but {model.model} runs on the "
                              f"transformers fallback ({reason}); use null")
        if reason is None and isinstance(fmt, ValueError):
            raise ConfigError(f"{name}.model", str(fmt))


def _fallback_reason(path: str, info) -> str | None:
    """Why `path` would run on the transformers fallback, or None (runtime.models.loader)."""
    from runtime.models.model_args import SUPPORTED_MODEL_TYPES, unsupported_reason

    if info.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {info.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if info.format != "hf":
        return None
    import transformers

    return unsupported_reason(transformers.AutoConfig.from_pretrained(path))


def check_tp(cfg: TandemConfig, infos: dict) -> None:
    from runtime.models.parallelize import check_tp_shape

    for name, model in model_lists(cfg):
        info = infos[name]
        if model.tp_size > 1:
            try:
                check_tp_shape(f"{info.model_type} model {model.model!r}",
                               info.num_attention_heads, info.num_key_value_heads,
                               model.tp_size)
            except ValueError as exc:
                raise ConfigError(f"{name}.devices", str(exc)) from None
