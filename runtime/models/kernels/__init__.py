"""Hand-written Triton kernels for the decode and verify steps, each with an eager reference.

Every kernel here has a plain-torch reference elsewhere in runtime/models (named in its
docstring) that the CPU runtime keeps using; CPU CI runs each kernel against its reference
under TRITON_INTERPRET=1 (tests/unit/models/test_kernels.py). `available(device)` says
whether a kernel can run on a device: Triton importable and a CUDA device, or the
interpreter on the CPU.

The model code asks `enabled()` at call time; the step runner turns the kernels on for the
CUDA-graph fast path (`enable`), unless TANDEM_TRITON=0 (the fused-torch path, for A/B runs).
`gemv_applies` says whether a linear runs as the small-M kernel (kernels/gemv.py):
TANDEM_GEMV=fp8 (default) for FP8 weights, `all` for float weights too, `0` never.
"""
from __future__ import annotations

import os

import torch

GEMV = os.environ.get("TANDEM_GEMV", "fp8")
if GEMV not in ("0", "fp8", "all"):
    raise ValueError(f"TANDEM_GEMV must be 0, fp8 or all, got {GEMV!r}")
GEMV_MAX_M = 16   # kernels/gemv.MAX_M (not imported here: that module needs Triton)


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA, or CPU under the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


_enabled = False


def enable(device: torch.device) -> bool:
    """Use the kernels from now on in this process if they can run on `device`."""
    global _enabled
    _enabled = os.environ.get("TANDEM_TRITON", "1") != "0" and available(device)
    return _enabled


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., K] @ weight^T runs as kernels.gemv.gemv: kernels enabled, at most
    GEMV_MAX_M rows, and the weight kind TANDEM_GEMV selects. Host-side facts only, so the
    choice is the same in eager and CUDA-graph steps."""
    if not _enabled or GEMV == "0" or x.dtype not in _GEMV_DTYPES:
        return False
    if weight.dtype != torch.float8_e4m3fn and GEMV != "all":
        return False
    return x.numel() <= GEMV_MAX_M * x.shape[-1] and weight.stride(-1) == 1


_GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemv_linear(*args, **kwargs) -> torch.Tensor:
    """kernels.gemv.gemv, imported on first use (Triton)."""
    from runtime.models.kernels.gemv import gemv as kernel

    return kernel(*args, **kwargs)
