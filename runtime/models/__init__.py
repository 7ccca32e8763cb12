"""Models behind a worker, in three rooms: `arch/` (the model itself), `loading/` (checkpoints
to a model on a device) and `runners/` (the fast path: static-shape steps, CUDA graphs, the KV
budget).

load_model(path, dtype, device, tp=None) -> CausalLM (see runtime.models.arch.base.CausalLM);
`tp` (parallel.groups.TPInfo) loads one tensor-parallel shard, see loading.loader.load_model.

Exports resolve lazily, so importing a light submodule (runtime.models.loading.checkpoint)
does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["CausalLM", "HFFallbackModel", "LlamaForCausalLM", "load_model"]

_EXPORTS = {
    "CausalLM": "runtime.models.arch.base",
    "HFFallbackModel": "runtime.models.loading.hf_fallback",
    "LlamaForCausalLM": "runtime.models.arch.llama",
    "load_model": "runtime.models.loading.loader",
}

if TYPE_CHECKING:
    from runtime.models.arch.base import CausalLM
    from runtime.models.arch.llama import LlamaForCausalLM
    from runtime.models.loading.hf_fallback import HFFallbackModel
    from runtime.models.loading.loader import load_model


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runtime.models' has no attribute {name!r}")
