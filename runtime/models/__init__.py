"""Models behind a worker: our Llama-family implementation and a transformers fallback.

load_model(path, dtype, device, tp=None) -> CausalLM (see runtime.models.base.CausalLM);
`tp` (parallel.groups.TPInfo) loads one tensor-parallel shard, see loader.load_model.

Exports resolve lazily, so importing a light submodule (runtime.models.checkpoint) does not
import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["CausalLM", "HFFallbackModel", "LlamaForCausalLM", "load_model"]

_EXPORTS = {
    "CausalLM": "runtime.models.base",
    "HFFallbackModel": "runtime.models.hf_fallback",
    "LlamaForCausalLM": "runtime.models.llama",
    "load_model": "runtime.models.loader",
}

if TYPE_CHECKING:
    from runtime.models.base import CausalLM
    from runtime.models.hf_fallback import HFFallbackModel
    from runtime.models.llama import LlamaForCausalLM
    from runtime.models.loader import load_model


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runtime.models' has no attribute {name!r}")
