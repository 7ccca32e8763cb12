"""Gemma 2's attention-logit soft cap in Triton device code, for the attention kernels
(kernels.attention_partial, kernels.prefill_kernel): scores s become cap * tanh(s / cap)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap) in float32 (Gemma 2's attention logits), tanh from one exp."""
    x = s / cap
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y) * cap
