"""Checks of a parsed TandemConfig that look beyond its own values: one backend per run,
CUDA devices that exist, model files (vocabularies, TP head shapes) and server
authentication. Each raises ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import math
import os

from parallel.devices import Device
from runtime.config.schema import ModelConfig, ServerConfig, TandemConfig
from runtime.config.vocab import check_vocab
from runtime.errors import ConfigError
from runtime.models.arch.model_args import check_tp_shape


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
            raise ConfigError(
                key,
                f"mixes {device.kind} and {first.kind} devices ({device} "
                f"here, {first} in {first_key}); one backend per run: use "
                f"only CUDA indices or only cpu:N slots in draft.devices "
                f"and target.devices",
            )


def check_cuda(cfg: TandemConfig) -> None:
    """Every CUDA device of the job's global numbering exists here; a device that names its
    node is checked by the ranks of that node (runtime.config.nodes)."""
    cuda = [(key, d) for key, d in all_devices(cfg) if d.kind == "cuda" and d.node is None]
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count()
    for key, device in cuda:
        if device.index >= count:
            raise ConfigError(
                key,
                f"device {device} does not exist: {count} CUDA device(s) "
                f"visible (torch.cuda.device_count() == {count}); "
                f"for CPU use cpu:N",
            )


def check_files(cfg: TandemConfig) -> None:
    from runtime.models.loading.checkpoint import inspect_checkpoint
    from runtime.models.loading.tokenizer import check_tokenizer_path

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
    # vocab_size may differ over one tokenizer (embeddings padded differently)
    check_vocab(cfg, draft.vocab_size, target.vocab_size)


def check_server_auth(server: ServerConfig, check_files: bool) -> None:
    from runtime.control import auth

    if server.auth_key_file is None:
        if not auth.is_loopback(server.address):
            raise ConfigError(
                "server.address",
                f"{server.address} listens beyond loopback; "
                "that requires server.auth_key_file (a shared secret)",
            )
        return
    if check_files:
        try:
            auth.load_key(server.auth_key_file)
        except auth.AuthError as exc:
            raise ConfigError("server.auth_key_file", str(exc)) from None


def check_quantization(cfg: TandemConfig, infos: dict) -> None:
    """`<model>.quantization: fp8` needs tandem's Llama-family implementation (the
    transformers fallback cannot quantize), and a checkpoint's own quantization_config must be
    a format tandem runs (runtime.models.loading.fp8_formats)."""
    from runtime.models.loading.fp8_formats import FP8Format, read_format

    for name, model in model_lists(cfg):
        fmt: FP8Format | ValueError | None
        try:
            fmt = read_format(model.model)
        except ValueError as exc:
            fmt = exc
        if model.quantization is None and fmt is None:
            continue
        reason = _fallback_reason(model.model, infos[name])
        if reason is not None and model.quantization is not None:
            raise ConfigError(
                f"{name}.quantization",
                f"{model.quantization} needs tandem's "
                f"Llama-family implementation, but {model.model} runs on the "
                f"transformers fallback ({reason}); use null",
            )
        if reason is None and isinstance(fmt, ValueError):
            raise ConfigError(f"{name}.model", str(fmt))


def _fallback_reason(path: str, info) -> str | None:
    """Why `path` would run on the transformers fallback, or None
    (runtime.models.loading.loader)."""
    from runtime.models.arch.model_args import (
        FALLBACK_LACKS,
        SUPPORTED_MODEL_TYPES,
        unsupported_reason,
    )

    if info.model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"model_type {info.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}; "
            f"{FALLBACK_LACKS}"
        )
    if info.format != "hf":
        return None
    import transformers

    return unsupported_reason(transformers.AutoConfig.from_pretrained(path))


def fit_context(cfg: TandemConfig, explicit: bool) -> TandemConfig:
    """runtime.max_seq_len against the models' context (max_position_embeddings, where the
    checkpoint gives one): a value the config sets must fit both draft and target; the
    default is lowered to the smaller context instead (as vLLM derives max_model_len)."""
    from runtime.models.loading.checkpoint import inspect_checkpoint

    limits = []
    for name, model in model_lists(cfg):
        context = inspect_checkpoint(model.model).max_position_embeddings
        if context is not None:
            limits.append((context, name, model.model))
    if not limits or cfg.runtime.max_seq_len <= min(limits)[0]:
        return cfg
    limit, name, path = min(limits)
    if explicit:
        raise ConfigError(
            "runtime.max_seq_len",
            f"{cfg.runtime.max_seq_len} exceeds the "
            f"{name} model's context: max_position_embeddings is {limit} "
            f"({path}); set runtime.max_seq_len to at most {limit}",
        )
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, max_seq_len=limit))


def check_kv_memory(cfg: TandemConfig) -> None:
    """CUDA devices: a KV cache that could not fit even before any weight is loaded is a
    config error now, not a worker's failure after its weights have loaded (the worker
    checks its exact budget again: runtime.models.runners.kv_budget). Free memory is read through
    NVML, which opens no CUDA context in this process (cudaMemGetInfo would keep one on
    every GPU for as long as the orchestrator lives); without NVML this check is skipped."""
    from runtime.models.loading.checkpoint import inspect_checkpoint

    per_device: dict[Device, list[tuple[str, int, float | None]]] = {}
    for name, model in model_lists(cfg):
        cuda = [
            device
            for device in model.devices  # this host's: node 0 or not named
            if device.kind == "cuda" and not device.node
        ]
        need = kv_cache_bytes(cfg, model, inspect_checkpoint(model.model)) if cuda else None
        if need is None:
            continue
        for device in cuda:
            per_device.setdefault(device, []).append((name, need, model.kv_cache_memory))
    if not per_device:
        return
    from runtime.models.runners.kv_budget import RESERVE  # imports torch: only with CUDA devices

    rt = cfg.runtime
    sizes = (
        f"{rt.kv_cache_tokens} tokens (runtime.kv_cache_tokens)"
        if rt.kv_cache_tokens
        else f"one request of {rt.max_seq_len} positions (runtime.max_seq_len)"
    )
    for device, needs in sorted(per_device.items(), key=lambda item: item[0].index):
        memory = _nvml_memory(device.index)
        if memory is None:
            return
        free, total = memory
        for name, need, fraction in needs:
            if fraction is not None and need > fraction * total:
                raise ConfigError(
                    f"{name}.kv_cache_memory",
                    f"the {name} KV cache needs at "
                    f"least {_size(need)} for {sizes}, but {fraction} of "
                    f"{device}'s {_size(total)} is {_size(fraction * total)}; "
                    f"lower runtime.kv_cache_tokens or runtime.max_seq_len, or "
                    f"raise {name}.kv_cache_memory",
                )
        shared = [(name, need) for name, need, fraction in needs if fraction is None]
        budget = free - RESERVE * total
        if shared and sum(need for _, need in shared) > budget:
            what = " + ".join(f"{name} {_size(need)}" for name, need in shared)
            raise ConfigError(
                "runtime.max_seq_len",
                f"the KV caches on {device} need at "
                f"least {what} for {sizes}, but {device} has {_size(free)} "
                f"free, {_size(max(budget, 0))} after a {RESERVE:.0%} reserve, "
                f"before any weights; lower runtime.kv_cache_tokens or "
                f"runtime.max_seq_len",
            )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def kv_cache_bytes(cfg: TandemConfig, model: ModelConfig, info) -> int | None:
    """At least the bytes of one model's KV pool on each of its devices: K and V of every
    layer for runtime.kv_cache_tokens, else one request of max_seq_len (with room for its
    draft windows: TandemConfig.kv_seq_len), in blocks of kv_block_size, and the scratch
    block; in the activation dtype, or 1 byte and a float32 scale per head and position
    (kv_cache_dtype fp8). None when the shape is unknown or the model runs on the
    transformers fallback (its own cache)."""
    from runtime.models.arch.cache import KVCache, blocks_for
    from runtime.models.arch.model_args import SUPPORTED_MODEL_TYPES

    if info.model_type not in SUPPORTED_MODEL_TYPES or not info.head_dim:
        return None
    kv_heads = max(1, info.num_key_value_heads // model.tp_size)  # a TP shard's heads
    rt = cfg.runtime
    blocks = blocks_for(rt.kv_cache_tokens or cfg.kv_seq_len, rt.kv_block_size)
    shape = KVCache.shape(blocks, rt.kv_block_size, kv_heads, info.head_dim)
    element = 4 if model.dtype == "float32" else 2
    if rt.kv_cache_dtype == "fp8":
        element = 1 + 4 / info.head_dim  # e4m3, and a float32 scale per head_dim values
    return int(2 * info.num_hidden_layers * math.prod(shape) * element)


def _nvml_memory(index: int) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device `index` (CUDA_VISIBLE_DEVICES respected) from
    NVML, or None when NVML cannot tell (no nvidia-ml-py, no driver)."""
    try:
        import pynvml
        from torch.cuda.memory import _get_nvml_device_index

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_get_nvml_device_index(index))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except Exception:  # noqa: BLE001 - any NVML or torch failure: cannot tell
        return None


def check_tp(cfg: TandemConfig, infos: dict) -> None:
    for name, model in model_lists(cfg):
        info = infos[name]
        if model.tp_size > 1:
            # imported here: it imports torch, which a launch without TP need not wait for
            try:
                check_tp_shape(
                    f"{info.model_type} model {model.model!r}",
                    info.num_attention_heads,
                    info.num_key_value_heads,
                    model.tp_size,
                )
            except ValueError as exc:
                raise ConfigError(f"{name}.devices", str(exc)) from None
