"""Hand-written Triton kernels for the decode and verify steps, each with an eager reference.

Every kernel here has a plain-torch reference elsewhere in runtime/models (named in its
docstring) that the CPU runtime keeps using; CPU CI runs each kernel against its reference
under TRITON_INTERPRET=1 (tests/unit/models/test_kernels.py). `available(device)` says
whether a kernel can run on a device: Triton importable and a CUDA device, or the
interpreter on the CPU.

The model code asks `enabled()` at call time; the step runner turns the kernels on for the
CUDA-graph fast path (`enable`), unless TANDEM_TRITON=0 (the fused-torch path, for A/B runs).
With them, TANDEM_L2_PREFETCH=1 (or `verify`: steps of 2 or more tokens a row only) reads
each GEMM's weights into L2 ahead of it (`ahead`, runtime.models.arch.kernels.prefetch).
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
# TANDEM_L2_PREFETCH: 1 reads ahead in every step, `verify` only in steps of 2 or more tokens
# a row (verify steps, prompt chunks: not the draft's or the target's decode steps)
_L2 = os.environ.get("TANDEM_L2_PREFETCH", "0")
L2_PREFETCH = _L2 in ("1", "verify")
L2_MIN_TOKENS = 2 if _L2 == "verify" else 1
_step_tokens = 1      # tokens a row of the forward being run (begin_step)


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


def ahead(weight: torch.Tensor, kind: str) -> None:
    """Read (part of) the next GEMM's weight into L2 while the small kernels before it run
    (kernels.prefetch.ahead), when the kernels are on and L2_PREFETCH; kind: qkv, o, gate_up
    or down (kernels.prefetch.CAPS_MB)."""
    if _enabled and L2_PREFETCH and _step_tokens >= L2_MIN_TOKENS:
        from runtime.models.arch.kernels import prefetch

        prefetch.ahead(weight, kind)


def begin_step(tokens: int) -> None:
    """A forward of `tokens` tokens a row starts (L2_MIN_TOKENS decides whether it reads
    ahead)."""
    global _step_tokens
    _step_tokens = tokens


def join(device: torch.device) -> None:
    """The current stream waits for the prefetches `ahead` launched (end of a forward)."""
    if _enabled and L2_PREFETCH:
        from runtime.models.arch.kernels import prefetch

        prefetch.join(device)
