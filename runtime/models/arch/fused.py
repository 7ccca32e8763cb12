"""The elementwise pieces of a decoder layer as the model calls them: eager, or compiled.

Each piece is written once in plain torch (runtime.models.arch.elementwise: norms,
activations, softmax, RoPE and the cache writes; runtime.models.arch.fp8_elementwise: the
quantize / rescale steps of the FP8 paths). This module is the table the model calls them
through. Eager by default (CPU, tests). On CUDA, `compile_kernels()` swaps in torch.compile'd
versions so each piece runs as one fused kernel instead of five to ten small ones: at batch 1 a
decode step is a few hundred small kernels whose fixed cost, not the weight reads, dominated.
Callers look the functions up on this module at call time (`fused.rms_norm(...)`), so the swap
reaches every model in the process. torch.compile's default shape handling applies: the first
shape seen is compiled static (the batch-1 decode step gets kernels specialised to it), and a
dimension seen to change is then compiled dynamic, so a handful of kernels serve every batch
size, step length and KV length while the feature dimensions stay static (vectorised).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from runtime.models.arch.elementwise import (
    add_rms_norm,
    gelu_tanh_mul,
    masked_softmax,
    rms_norm,
    rotary_write,
    silu_mul,
    unit_offset_rms_norm,
)
from runtime.models.arch.fp8_elementwise import (
    add_rms_norm_fp8,
    fp8_dequantize,
    fp8_quantize_heads,
    fp8_quantize_rows,
    fp8_rescale,
    rescale_add_rms_norm,
    rms_norm_fp8,
    rotary_write_fp8,
    rotary_write_fp8_kv8,
    rotary_write_kv8,
    silu_mul_fp8,
)

log = logging.getLogger("tandem.models")

_EAGER = {
    fn.__name__: fn
    for fn in (
        rms_norm,
        add_rms_norm,
        rotary_write,
        silu_mul,
        masked_softmax,
        unit_offset_rms_norm,
        gelu_tanh_mul,
        fp8_dequantize,
        fp8_quantize_rows,
        fp8_rescale,
        rms_norm_fp8,
        add_rms_norm_fp8,
        rescale_add_rms_norm,
        silu_mul_fp8,
        rotary_write_fp8,
        fp8_quantize_heads,
        rotary_write_kv8,
        rotary_write_fp8_kv8,
    )
}
# inductor options per function: the FP8 neighbours keep eager's bf16/fp16 roundings (by
# default inductor elides a downcast-upcast pair between two fused ops, and contracts
# multiply-adds), so fused and unfused sequences round at the same points
_PRECISE: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
_OPTIONS = {
    name: _PRECISE
    for name in (
        "rms_norm_fp8",
        "add_rms_norm_fp8",
        "rescale_add_rms_norm",
        "silu_mul_fp8",
        "rotary_write_fp8",
        "fp8_quantize_heads",
        "rotary_write_fp8_kv8",
    )
}
_compiled = False


def _probe(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return silu_mul(x) * weight + 1.0


def _check_compiler(device: torch.device) -> None:
    """Compile and run a small function: torch.compile compiles lazily, so a missing compiler
    would otherwise surface in the middle of a request. (A separate function: calling the
    real ones at toy shapes would make torch.compile treat every dimension as dynamic.)"""
    x = torch.randn(2, 8, device=device, dtype=torch.bfloat16)
    torch.compile(_probe, fullgraph=True)(x, torch.ones(4, device=device, dtype=x.dtype))


def pdl_supported(device: torch.device) -> bool:
    """Whether the compiled pieces launch with programmatic dependent launch (PDL) on
    `device`: a CUDA device of compute capability 9.0 or later.

    With PDL a kernel is launched while the one before it still runs and waits on the device
    (griddepcontrol.wait) for its results: launch and ramp-up overlap the previous kernel's
    tail (inductor's `triton.enable_pdl` writes the waits). Measured on an H200 with
    lab/gpu/step_ab.py: 8b steps 0.3-0.9% faster, logits the same bit for bit
    (docs/benchmarks.md)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _inductor_pdl(device: torch.device) -> None:
    """Set inductor's PDL switch by pdl_supported, unless TORCHINDUCTOR_ENABLE_PDL (its own
    variable) is set or this torch has no such switch."""
    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_ENABLE_PDL" not in os.environ and hasattr(
        inductor_config.triton, "enable_pdl"
    ):
        inductor_config.triton.enable_pdl = pdl_supported(device)


def compile_kernels(device: torch.device) -> bool:
    """Replace this module's functions by torch.compile'd ones (once per process) and compile
    them on `device`. Returns whether they are compiled; on failure (no C compiler, no triton)
    the eager ones stay and a warning says why."""
    global _compiled
    if _compiled:
        return True
    try:
        _inductor_pdl(device)
        _check_compiler(device)
        for name in ("recompile_limit", "cache_size_limit"):  # shapes: see the docstring
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        globals().update(
            {
                name: torch.compile(fn, fullgraph=True, options=_OPTIONS.get(name))
                for name, fn in _EAGER.items()
            }
        )
    except Exception as exc:  # noqa: BLE001 - fall back to eager, say why
        globals().update(_EAGER)
        log.warning(
            "torch.compile failed, decoder pieces stay eager: %s: %s", type(exc).__name__, exc
        )
        return False
    _compiled = True
    return True


def use_eager() -> None:
    """Undo compile_kernels (tests)."""
    global _compiled
    globals().update(_EAGER)
    _compiled = False
