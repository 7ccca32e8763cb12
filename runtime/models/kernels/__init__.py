"""Hand-written Triton kernels for the decode and verify steps, each with an eager reference.

Every kernel here has a plain-torch reference elsewhere in runtime/models (named in its
docstring) that the CPU runtime keeps using; CPU CI runs each kernel against its reference
under TRITON_INTERPRET=1 (tests/unit/models/test_kernels.py). `available(device)` says
whether a kernel can run on a device: Triton importable and a CUDA device, or the
interpreter on the CPU.

The model code asks `enabled()` at call time; the step runner turns the kernels on for the
CUDA-graph fast path (`enable`); without them (no Triton, or eager runs) attention takes the
fused-torch path.
"""

from __future__ import annotations

import os

import torch


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
    _enabled = available(device)
    return _enabled


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled
