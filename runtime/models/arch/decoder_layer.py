"""One decoder layer of the Llama family: attention and the gated MLP between norms placed as
the family places them (model_args.NormPlacement: PRE, POST, SANDWICH), the residual adds
folded into the next norm (add_then_norm), and on the FP8 GEMM path the quantize / rescale
steps folded into the norms and the activation (runtime.models.arch.fused)."""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.arch import fused
from runtime.models.arch.attention import Attention
from runtime.models.arch.cache import ExtendBatch
from runtime.models.arch.model_args import ModelArgs, NormPlacement
from runtime.models.arch.norms import RMSNorm, norm_class
from runtime.models.arch.quant import FP8Act, FP8Mixin, FP8Out, RowStack, fuses_fp8, stack_rows

Delta = torch.Tensor | FP8Out | None


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: RowStack | None = None  # set by fuse_projections
        self.gelu = args.activation == "gelu_tanh"  # Gemma's GeGLU, else SwiGLU

    def fuse_projections(self) -> None:
        """One [2I, hidden] GEMM for gate and up (float or FP8); their weights become views."""
        self.gate_up = stack_rows(self.gate_proj, self.up_proj)

    def fp8_fused(self, x: torch.Tensor) -> bool:
        """Whether forward takes an FP8Act (quant.fuses_fp8): gate_up and down_proj FP8 GEMMs
        (SwiGLU only: fused.silu_mul_fp8 is its epilogue)."""
        return not self.gelu and fuses_fp8(x, self.gate_up, self.down_proj)

    def forward(self, x: torch.Tensor | FP8Act) -> torch.Tensor | FP8Out:
        # x [B, T, hidden] -> [B, T, hidden]; or the fused FP8 path (fp8_fused): x the FP8Act
        # of [M, hidden] -> down_proj's FP8Out [M, hidden] (or rescaled [M, hidden] under TP)
        if isinstance(x, FP8Act):
            assert self.gate_up is not None and isinstance(self.down_proj, FP8Mixin)  # fp8_fused
            raw = self.gate_up.forward_fp8(x)  # [M, 2I]
            a8, a_scale = fused.silu_mul_fp8(*raw, x.dtype)  # [M, I], [M, 1]
            return self.down_proj.forward_fp8(FP8Act(a8, a_scale, x.dtype))
        if self.gate_up is None:
            gate = self.gate_proj(x)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            return self.down_proj(act * self.up_proj(x))
        gate_up = self.gate_up(x).flatten(0, 1)  # [B*T, 2I]
        act = fused.gelu_tanh_mul(gate_up) if self.gelu else fused.silu_mul(gate_up)
        return self.down_proj(act.view(*x.shape[:2], -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.norms = placement = args.norm_placement
        self.rope_type = args.layer_rope[layer_idx] if args.layer_rope else None
        h, eps, norm = args.hidden_size, args.rms_norm_eps, norm_class(args)
        if placement is not NormPlacement.POST:  # POST (OLMo 2): no input norm
            self.input_layernorm = norm(h, eps)
        if placement is not NormPlacement.PRE:  # POST, SANDWICH: the MLP's output normed
            self.post_feedforward_layernorm = norm(h, eps)
        if placement is NormPlacement.SANDWICH:
            self.pre_feedforward_layernorm = norm(h, eps)
        self.post_attention_layernorm = norm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        delta: Delta,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ExtendBatch,
    ) -> tuple[torch.Tensor, Delta]:
        """x [B, T, hidden] the residual stream without `delta`, the previous layer's MLP
        output (None for the first layer): adding it is fused into this layer's input norm.
        Returns (residual stream, this layer's MLP output), likewise not yet added.

        On the FP8 GEMM path (quant.fuses_fp8, decided from host-side facts, so the same in
        eager and CUDA-graph steps) the attention's and the MLP's input norms also quantize
        for their first GEMM, and the outputs of o_proj and down_proj may be raw (FP8Out):
        the next norm rescales them (the quantize / rescale steps fold into neighbours)."""
        match self.norms:
            case NormPlacement.PRE:
                return self._forward_pre(x, delta, cos, sin, batch)
            case NormPlacement.POST:
                return self._forward_post(x, delta, cos, sin, batch)
            case NormPlacement.SANDWICH:
                return self._forward_sandwich(x, delta, cos, sin, batch)

    def _forward_pre(
        self,
        x: torch.Tensor,
        delta: Delta,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ExtendBatch,
    ) -> tuple[torch.Tensor, Delta]:
        """PRE (Llama, Qwen, Phi): x + attn(input(x)), then + mlp(post_attention(.))
        (returned as the delta), each add fused into the next norm (add_then_norm), and on
        the FP8 path the quantize / rescale steps too."""
        attn_fp8, mlp_fp8 = self.self_attn.fp8_fused(x), self.mlp.fp8_fused(x)
        x, h = add_then_norm(x, delta, self.input_layernorm, attn_fp8)
        attn = self.self_attn(h, cos, sin, batch)
        x, h = add_then_norm(x, attn, self.post_attention_layernorm, mlp_fp8)
        return x, self.mlp(h)

    def _forward_post(
        self,
        x: torch.Tensor,
        delta: Delta,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ExtendBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """POST (OLMo 2): x + norm(attn(x)), then + norm(mlp(.)) (returned as the delta).
        Its norms follow the GEMMs, so it takes no fused FP8 path (FP8 linears quantize on
        their own)."""
        x = residual(x, delta)
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, batch))
        return x, self.post_feedforward_layernorm(self.mlp(x))

    def _forward_sandwich(
        self,
        x: torch.Tensor,
        delta: Delta,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ExtendBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SANDWICH (Gemma 2 / 3): x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.)))
        (returned as the delta). Norms sit on both sides of each GEMM block, so it takes no
        fused FP8 path (FP8 linears quantize on their own)."""
        x = residual(x, delta)
        attn = self.self_attn(self.input_layernorm(x), cos, sin, batch)
        x = x + self.post_attention_layernorm(attn)
        return x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def residual(x: torch.Tensor, delta: Delta) -> torch.Tensor:
    """x + delta (x when delta is None) where delta is a float tensor: the output of a layer
    whose norms fold no FP8 rescale (POST, SANDWICH; a norm that is not `fusable`)."""
    if delta is None:
        return x
    assert not isinstance(delta, FP8Out), "an FP8 GEMM's raw output needs a fused norm"
    return x + delta


@overload
def add_then_norm(
    x: torch.Tensor, delta: Delta, norm: RMSNorm, quantize: Literal[False] = False
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def add_then_norm(
    x: torch.Tensor, delta: Delta, norm: RMSNorm, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor | FP8Act]: ...


def add_then_norm(
    x: torch.Tensor, delta: Delta, norm: RMSNorm, quantize: bool = False
) -> tuple[torch.Tensor, torch.Tensor | FP8Act]:
    """(x + delta, norm(x + delta)) in one fused kernel; x and norm(x) when delta is None.
    x [B, T, hidden]; delta [B, T, hidden] or [M, hidden] in x.dtype, or an FP8 GEMM's raw
    output (FP8Out: its rescale is folded in). quantize: the norm comes back quantized for
    the next FP8 GEMM (FP8Act of [M, hidden], the quantization folded in). A norm that is
    not `fusable` (Gemma's) adds, then norms on its own."""
    if not norm.fusable:
        x = residual(x, delta)
        return x, norm(x)
    if quantize:
        return _add_then_norm_fp8(x, delta, norm)
    rows, weight, eps = x.flatten(0, 1), norm.weight, norm.variance_epsilon  # [M, hidden]
    if delta is None:
        return x, norm(x)
    if isinstance(delta, FP8Out):
        s, h = fused.rescale_add_rms_norm(rows, *delta, weight, eps)
    else:
        s, h = fused.add_rms_norm(rows, delta.reshape(rows.shape), weight, eps)
    return s.view(x.shape), h.view(x.shape)


def _add_then_norm_fp8(x: torch.Tensor, delta: Delta, norm: RMSNorm) -> tuple[torch.Tensor, FP8Act]:
    rows, weight, eps = x.flatten(0, 1), norm.weight, norm.variance_epsilon  # [M, hidden]
    if delta is None:
        return x, FP8Act(*fused.rms_norm_fp8(rows, weight, eps), x.dtype)
    if isinstance(delta, FP8Out):
        s, h8, h_scale = fused.add_rms_norm_fp8(
            rows, delta.raw, weight, eps, delta.x_scale, delta.w_scale, delta.bias
        )
    else:
        s, h8, h_scale = fused.add_rms_norm_fp8(rows, delta.reshape(rows.shape), weight, eps)
    return s.view(x.shape), FP8Act(h8, h_scale, x.dtype)
