"""Rotary position embedding (RoPE), computed on the fly for arbitrary per-token positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.models.arch.model_args import LENGTH_DEPENDENT_ROPE, rope_parameters


def compute_inv_freq(
    config: Any, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float, int | None]:
    """(inv_freq [head_dim // 2] float32 on CPU, attention_scaling, exact_until).

    'default' RoPE is plain 1 / theta^(2i/d); every other type goes through transformers'
    ROPE_INIT_FUNCTIONS so llama3 / yarn / linear scaling match transformers exactly.
    exact_until: for length-dependent types (dynamic, longrope) the largest sequence length
    for which the static table equals transformers' frequencies; None when always exact.
    layer_type: the table of that layer type (Gemma 3: model_args.rope_layer_types)."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    with torch.device("cpu"):  # also when the model is being built under a meta device context
        if rope_type == "default":
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
                config, torch.device("cpu"), **kwargs
            )
    exact_until = None
    if rope_type in LENGTH_DEPENDENT_ROPE:
        exact_until = (
            params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings
        )
    return inv_freq.float(), float(scaling), exact_until


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a buffer [D/2] float32

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32
        self.attention_scaling = attention_scaling

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, T, D] in `dtype` (computed in float32 like HF)
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
