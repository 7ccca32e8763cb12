"""The elementwise pieces of a decoder layer, each written once in plain torch.

Eager by default (CPU, tests). On CUDA, `compile_kernels()` swaps in torch.compile'd versions
so each piece runs as one fused kernel instead of five to ten small ones: at batch 1 a decode
step is a few hundred small kernels whose fixed cost, not the weight reads, dominated.
Callers look the functions up on this module at call time (`fused.rms_norm(...)`), so the swap
reaches every model in the process. Inputs are flattened to [tokens, ...] so that one compiled
kernel serves every batch size and step length (dynamic shapes).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("tandem.models")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the next norm in one pass."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [N, H, D] and k [N, Hkv, D] with cos, sin [N, D] (transformers' rotate_half)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scores * scale) over the last axis where mask allows, in float32, cast back."""
    masked = (scores.float() * scale).masked_fill(~mask, float("-inf"))
    return masked.softmax(dim=-1).to(scores.dtype)


_EAGER = {fn.__name__: fn for fn in (rms_norm, add_rms_norm, rotary, silu_mul, masked_softmax)}
_compiled = False


def _probe(device: torch.device) -> None:
    """Call every function once on small inputs: torch.compile compiles lazily, so a missing
    compiler would otherwise surface in the middle of a request."""
    x = torch.randn(2, 8, device=device, dtype=torch.bfloat16)
    w = torch.ones(8, device=device, dtype=torch.bfloat16)
    rms_norm(x, w, 1e-5)
    add_rms_norm(x, x, w, 1e-5)
    q, k, cs = (torch.randn(2, n, 8, device=device) for n in (4, 2, 1))
    rotary(q, k, cs[:, 0], cs[:, 0])
    silu_mul(x)
    masked_softmax(x, x > 0, 0.5)


def compile_kernels(device: torch.device) -> bool:
    """Replace this module's functions by torch.compile'd ones (once per process) and compile
    them on `device`. Returns whether they are compiled; on failure (no C compiler, no triton)
    the eager ones stay and a warning says why."""
    global _compiled
    if _compiled:
        return True
    try:
        globals().update({name: torch.compile(fn, dynamic=True, fullgraph=True)
                          for name, fn in _EAGER.items()})
        _probe(device)
    except Exception as exc:  # noqa: BLE001 - fall back to eager, say why
        globals().update(_EAGER)
        log.warning("torch.compile failed, decoder pieces stay eager: %s: %s",
                    type(exc).__name__, exc)
        return False
    _compiled = True
    return True


def use_eager() -> None:
    """Undo compile_kernels (tests)."""
    global _compiled
    globals().update(_EAGER)
    _compiled = False
