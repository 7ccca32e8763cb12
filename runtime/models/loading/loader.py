"""load_model: HF checkpoint directory or .gguf file -> CausalLM on a device.

Llama-family checkpoints (model_type llama / mistral / qwen2 / qwen3 / olmo2 / phi3:
model_args.SUPPORTED_MODEL_TYPES) get our LlamaForCausalLM, built on the meta device and
filled tensor by tensor; anything else gets HFFallbackModel. Fused checkpoint projections
(Phi-3's qkv_proj, gate_up_proj) are read as their parts (loading.fused_tensors).
`build_model`, `open_weights` and `load_weights` are public so tensor parallelism can shard
the meta model before loading.

Tensor parallelism: with a TPInfo of size > 1, load_model shards the meta model with
runtime.models.arch.parallelize.apply_tp (imported only then: this package holds no collectives
and imports no communication library), and load_weights reads, for every sharded
parameter, only the rank's slice (`model.tp_shards`: parameter name -> Shard, set by apply_tp).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from runtime.models.arch.llama import LlamaForCausalLM
from runtime.models.arch.model_args import ModelArgs, unsupported_reason
from runtime.models.arch.quant import load_dtype
from runtime.models.loading import gguf_cache, portable_config
from runtime.models.loading.fused_tensors import split_fused
from runtime.models.loading.synthetic import RECIPE_FILE, SyntheticWeights
from runtime.models.loading.weights import SafetensorsWeights, WeightSource

if TYPE_CHECKING:
    from parallel.groups import TPInfo

logger = logging.getLogger(__name__)

# tensors some checkpoints carry that hold nothing to load (recomputed buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _resolve(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(directory, gguf file name or None); clear errors for paths that are not checkpoints."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf; pass an HF checkpoint "
                f"directory (config.json + *.safetensors) or a .gguf file"
            )
        return p.parent, p.name
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint: config.json is missing")
    return p, None


def load_config(path: str | os.PathLike) -> Any:
    """The transformers config of an HF checkpoint directory or a .gguf file (once read,
    a config our model runs comes from the cache as a PortableConfig, without importing
    transformers: runtime.models.loading.portable_config)."""
    directory, gguf_file = _resolve(path)
    if gguf_file:  # parsing the GGUF takes seconds: converted once, then cached on disk
        return gguf_cache.load_config(directory / gguf_file)

    def read():
        import transformers

        return transformers.AutoConfig.from_pretrained(str(directory))

    return portable_config.load_hf(directory, read)


def build_model(config: Any) -> LlamaForCausalLM:
    """Our model for `config` with parameters on the meta device (no memory, no init)."""
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        return LlamaForCausalLM(args)


def open_weights(
    path: str | os.PathLike,
    model: LlamaForCausalLM | None = None,
    config: Any = None,
    device: torch.device | str = "cpu",
) -> WeightSource:
    """Weight source of a checkpoint; GGUF needs the config and the model's parameter names.
    A synthetic recipe (runtime.models.loading.synthetic) draws its tensors on `device`.
    Given the model, fused projections (Phi-3's) read as their parts (fused_tensors)."""
    directory, gguf_file = _resolve(path)
    if gguf_file is None:
        weights = (
            SyntheticWeights(directory, device)
            if (directory / RECIPE_FILE).is_file()
            else SafetensorsWeights(directory)
        )
        return weights if model is None else split_fused(weights, model.args)
    if model is None or config is None:
        raise ValueError("opening a .gguf needs the model (for tensor names) and its config")
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return gguf_cache.open_weights(directory / gguf_file, config, names)  # GGUFWeights' tensors


def _check_names(expected: set[str], optional: set[str], available: set[str]) -> None:
    missing = sorted(expected - available)
    unexpected = sorted(
        n for n in available - expected - optional if not n.endswith(IGNORED_SUFFIXES)
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors: {_preview(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors: {_preview(unexpected)}")
    if problems:
        raise ValueError("checkpoint does not match the model: " + "; ".join(problems))


def _preview(names: list[str], limit: int = 8) -> str:
    more = f", ... (+{len(names) - limit})" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = getattr(module, attr)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, model "
            f"expects {tuple(old.shape)}"
        )
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def load_weights(
    model: LlamaForCausalLM,
    source: WeightSource,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: Callable[[int, int], None] | None = None,
) -> LlamaForCausalLM:
    """Fill every parameter of `model` (e.g. on meta) from `source`; move all to device.
    `progress(done, total)` hears of every tensor read (or drawn, for a synthetic recipe).

    Parameters listed in `model.tp_shards` (set by runtime.models.arch.parallelize.apply_tp) are
    read
    as that shard only; the others are read whole (replicated)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shards = getattr(model, "tp_shards", None) or {}
    tied = model.args.tie_word_embeddings
    expected = set(params) - ({"lm_head.weight"} if tied else set())
    optional = {"lm_head.weight"} if tied else set()  # some tied checkpoints store it anyway
    _check_names(expected, optional, source.names())
    names = sorted(expected)
    if progress is not None:
        progress(0, len(names))
    for done, name in enumerate(names, 1):
        shard = shards.get(name)
        tensor = source.get(name) if shard is None else source.get_shard(name, *shard)
        _assign(model, name, tensor.to(device=device, dtype=load_dtype(model, name, dtype)))
        if progress is not None:
            progress(done, len(names))
    model.tie_weights()
    model.to(device)  # buffers (RoPE inv_freq stays float32)
    return model.eval()


def _tp_enabled(tp: TPInfo | None) -> TypeGuard[TPInfo]:
    return tp is not None and tp.size > 1


def no_gemm_workspace(device: torch.device) -> None:
    """On CUDA, run this process's GEMMs without a cuBLAS or cuBLASLt workspace, unless the
    user set torch's variables for them (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE;
    read at the process's first GEMM, so before any forward is early enough). Without a
    workspace the libraries pick no split-K algorithm for the decode GEMMs, so the separate
    reduction kernels after them go (bf16 8b: 2 a layer, FP8: 1, FP8 70b: 2) and the GEMMs
    run as fast: measured on an H200 (lab/gpu/step_ab.py, docs/benchmarks.md) 8b bf16
    steps 0.8-1.6% faster, FP8 1.9-2.2%, FP8 70b 1.5-1.8%."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")


def _load_ours(
    path: str | os.PathLike,
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPInfo | None = None,
    gather_logits: bool = True,
    quantization: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> LlamaForCausalLM:
    device = torch.device(device)
    no_gemm_workspace(device)
    model = build_model(config)
    if _tp_enabled(tp):
        from runtime.models.arch.parallelize import apply_tp

        apply_tp(model, tp, gather_logits=gather_logits)
    source = open_weights(path, model, config, device)
    try:
        from runtime.models.loading import fp8_load

        source = fp8_load.prepare(model, source, path, quantization, device)  # FP8 layers
        model = load_weights(model, source, dtype, device, progress)
    finally:
        source.close()
    model.fuse_projections()
    return model


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPInfo | None = None,
    *,
    gather_logits: bool = True,
    quantization: str | None = None,
    progress: Callable[[int, int], None] | None = None,
):
    """HF checkpoint directory (config.json + safetensors, sharded or single) or .gguf file ->
    our LlamaForCausalLM for model_args.SUPPORTED_MODEL_TYPES, else HFFallbackModel. Eval mode, on
    `device`, in `dtype`.

    `tp` (parallel.groups.TPInfo): None or size 1 loads the whole model. Otherwise
    this rank's tensor-parallel shard is built and only its slices are read; every rank of
    the group must call load_model. forward_extend then returns the full [B, T, V] logits on
    every rank, or with gather_logits=False only this rank's vocab slice (see apply_tp).

    `quantization`: None loads the weights as stored (FP8 checkpoints run in FP8); "fp8"
    quantizes q/k/v/o/gate/up/down to FP8 while loading (runtime.models.loading.fp8_load).
    `progress(done, total)`: called per tensor loaded (not by the transformers fallback)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device(device)
    config = load_config(path)
    reason = unsupported_reason(config)
    if reason is None:
        return _load_ours(path, config, dtype, device, tp, gather_logits, quantization, progress)
    if _tp_enabled(tp):
        raise NotImplementedError(
            f"tensor parallelism (size {tp.size}) needs our native "
            f"implementation, but {path} needs the transformers "
            f"fallback: {reason}"
        )
    if quantization is not None:
        raise ValueError(
            f"quantization {quantization!r} needs our native "
            f"implementation, but {path} needs the transformers fallback: {reason}"
        )
    from runtime.models.loading.hf_fallback import HFFallbackModel

    logger.info("using the transformers fallback for %s: %s", path, reason)
    return HFFallbackModel.from_pretrained(path, dtype, device)
