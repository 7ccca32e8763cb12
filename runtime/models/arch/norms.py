"""RMSNorm as the Llama family computes it (transformers' LlamaRMSNorm), also the q/k norms of
Qwen3 (over each head's head_dim) and OLMo 2 (over the whole projected q or k); GemmaRMSNorm
as Gemma 2 / 3 compute theirs (scaled by 1 + weight in float32, then cast)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.models.arch import fused
from runtime.models.arch.model_args import ModelArgs


class RMSNorm(nn.Module):
    fusable = True  # decoder_layer.add_then_norm may fold it into fused.add_rms_norm (and FP8)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., dim] -> [..., dim], normalised over the last dim
        return fused.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon).view(
            x.shape
        )


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma2RMSNorm / Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all
    in float32, cast back (the checkpoint's weight is the offset from 1)."""

    fusable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.unit_offset_rms_norm(
            x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon
        ).view(x.shape)


def norm_class(args: ModelArgs) -> type[RMSNorm]:
    """A family's RMSNorm: GemmaRMSNorm where its norms scale by (1 + w)
    (ModelArgs.unit_offset_norms), else RMSNorm."""
    return GemmaRMSNorm if args.unit_offset_norms else RMSNorm
