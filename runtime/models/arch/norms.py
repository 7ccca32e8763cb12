"""RMSNorm as the Llama family computes it (transformers' LlamaRMSNorm), also the q/k norms of
Qwen3 (over each head's head_dim) and OLMo 2 (over the whole projected q or k)."""
from __future__ import annotations

import torch
from torch import nn

from runtime.models.arch import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., dim] -> [..., dim], normalised over the last dim
        return fused.rms_norm(x.reshape(-1, x.shape[-1]), self.weight,
                              self.variance_epsilon).view(x.shape)
