"""Llama-family decoder with HF-identical parameter names: Llama, Mistral, Qwen2, and the
families that differ from it as data (model_args: QK_NORM, NORM_PLACEMENT, GEMMA, ...): Qwen3,
OLMo 2, Phi-3 (its fused qkv_proj / gate_up_proj are split on load: loading.fused_tensors),
Gemma 2 and Gemma 3 text (four (1 + w) norms a layer, GeGLU, scaled embeddings, per-layer
attention scale / soft-cap, a RoPE table per layer type, final logit soft-capping)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.arch import fused
from runtime.models.arch.attention import Attention
from runtime.models.arch.base import PagedModel, check_extend_args
from runtime.models.arch.cache import ExtendBatch, as_block_table, blocks_for
from runtime.models.arch.model_args import ModelArgs, NormPlacement
from runtime.models.arch.norms import RMSNorm, norm_class
from runtime.models.arch.quant import FP8Act, FP8Mixin, FP8Out, RowStack, fuses_fp8, stack_rows
from runtime.models.arch.rope import RotaryEmbedding, compute_inv_freq

if TYPE_CHECKING:
    from parallel.groups import TPInfo
    from parallel.layers import Shard


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


Delta = torch.Tensor | FP8Out | None


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


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # an uninitialised weight: the loader fills it (nn.Embedding's own normal_ init would,
        # on the meta device, import torch._dynamo: 1.5 s of every worker's start)
        self.embed_tokens = nn.Embedding(
            args.vocab_size,
            args.hidden_size,
            _weight=torch.empty(args.vocab_size, args.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = norm_class(args)(args.hidden_size, args.rms_norm_eps)
        # Gemma: embeddings times sqrt(hidden_size) rounded to the embedding's dtype
        self.embed_scale = args.hidden_size**0.5 if args.scale_embeddings else None

    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers` as what they are (an nn.ModuleList holds plain Modules to a type checker)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ExtendBatch,
        tables: dict | None = None,
    ) -> torch.Tensor:
        """tables: layer type -> (cos, sin) for layers with a RoPE table of their own."""
        x, delta = self.embed_tokens(input_ids), None  # [B, T, hidden]
        if self.embed_scale is not None:
            # a Python float equal to transformers' float32 scale cast to x's dtype
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype).item()
        for layer in self.layers:
            rope = (tables or {}).get(layer.rope_type, (cos, sin))
            x, delta = layer(x, delta, *rope, batch)
        return add_then_norm(x, delta, self.norm)[1]


class LlamaForCausalLM(nn.Module):
    """Our CausalLM, a PagedModel (runtime.models.arch.base). Build from ModelArgs (see
    runtime.models.loading.loader.load_model for weights)."""

    paged: ClassVar[bool] = True
    # set by runtime.models.arch.parallelize.apply_tp on a tensor-parallel shard only
    tp: TPInfo
    tp_plan: Any  # parallelize.TPPlan (parallelize imports this module)
    tp_shards: dict[str, Shard]  # parameter name -> the checkpoint slice it holds

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._build_rope(args)
        self.num_slots: int | None = None
        self.max_seq_len: int | None = None
        self.block_size, self.blocks_per_seq, self.num_blocks = 16, 0, 0  # allocate_cache
        self.tie_weights()

    def _build_rope(self, args: ModelArgs) -> None:
        """rotary_emb, the table of every layer; with a table per layer type (Gemma 3:
        model_args.rope_layer_types) that of full-attention layers, and rotary_by_type the
        others' (sliding layers: the local base)."""
        cfg, types = args.hf_config, sorted(set(args.layer_rope))
        main = "full_attention" if types else None
        inv_freq, scaling, self.rope_exact_until = compute_inv_freq(cfg, args.head_dim, main)
        self.rotary_emb = RotaryEmbedding(inv_freq, scaling)
        self.rotary_by_type = nn.ModuleDict()
        for layer_type in (t for t in types if t != main):
            inv_freq, scaling, exact = compute_inv_freq(cfg, args.head_dim, layer_type)
            self.rotary_by_type[layer_type] = RotaryEmbedding(inv_freq, scaling)
            if exact is not None:
                self.rope_exact_until = min(exact, self.rope_exact_until or exact)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into one GEMM each (after loading, TP shards included)."""
        for layer in self.model.decoder_layers():
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def allocate_cache(
        self,
        num_slots: int,
        max_seq_len: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_dtype: str = "auto",
    ) -> None:
        """Block pools of `num_blocks` blocks of block_size positions, the same in every
        layer; a block table is blocks_per_seq = ceil(max_seq_len / block_size) wide.
        num_blocks defaults to num_slots x blocks_per_seq (every slot's fixed table,
        cache.slot_block_table, fits). kv_dtype: "auto" (the activation dtype) or "fp8"
        (e4m3 with scales, runtime.kv_cache_dtype)."""
        if num_slots < 1 or max_seq_len < 1 or block_size < 1:
            raise ValueError(
                f"need num_slots, max_seq_len, block_size >= 1, got "
                f"{num_slots}, {max_seq_len}, {block_size}"
            )
        if self.rope_exact_until is not None and max_seq_len > self.rope_exact_until:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds {self.rope_exact_until}, the "
                f"length up to which this length-dependent RoPE is supported"
            )
        self.blocks_per_seq = blocks_for(max_seq_len, block_size)
        self.num_blocks = num_slots * self.blocks_per_seq if num_blocks is None else num_blocks
        if self.num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {self.num_blocks}")
        norm = self.model.norm.weight  # the activation dtype (FP8 weights have another)
        for layer in self.model.decoder_layers():
            layer.self_attn.allocate_cache(
                self.num_blocks, block_size, norm.dtype, norm.device, kv_dtype=kv_dtype
            )
        self.num_slots, self.max_seq_len, self.block_size = num_slots, max_seq_len, block_size

    def free_slot(self, slot: int) -> None:
        """Nothing to do: the caller owns lengths and stale positions are never attended."""

    def forward(
        self, input_ids: torch.Tensor, rows, start_pos: torch.Tensor, n_valid: torch.Tensor
    ) -> torch.Tensor:
        """input_ids [B, T]; rows: block tables [B, M] (or slots [B]: their fixed tables,
        cache.slot_block_table); start_pos, n_valid [B] -> logits [B, T, V]."""
        if self.max_seq_len is None:
            raise RuntimeError("allocate_cache() must be called before forward_extend()")
        start_pos, n_valid = (
            torch.as_tensor(t).to(input_ids.device, torch.long) for t in (start_pos, n_valid)
        )
        rows = torch.as_tensor(rows).to(input_ids.device)
        if rows.dim() == 1:  # slots: checked as slots, then their fixed tables
            kv_len = check_extend_args(
                input_ids, rows, start_pos, n_valid, self.num_slots, self.max_seq_len
            )
        else:
            limit = min(self.max_seq_len, rows.shape[1] * self.block_size)
            kv_len = check_extend_args(input_ids, rows, start_pos, n_valid, self.num_blocks, limit)
        table = as_block_table(rows, self.blocks_per_seq, input_ids.device)
        return self.forward_static(input_ids, table, start_pos, n_valid, kv_len)

    def forward_static(
        self,
        input_ids: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """forward without checks or host synchronisation: the caller guarantees the
        arguments are valid (block_table [B, M] int32 with contiguous rows) and
        kv_len >= max(start_pos + n_valid). Shapes depend only on input_ids.shape,
        block_table.shape and kv_len, so a CUDA graph can capture it
        (runtime.models.runners.step_runner) and replay it for any table."""
        return self.logits(
            self.hidden_static(input_ids, block_table, start_pos, n_valid, kv_len)
        )  # [B, T, V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head of hidden states [..., hidden] -> [..., V] (V local when the head is
        vocab-parallel), soft-capped where the family does (Gemma: c * tanh(x / c),
        elementwise, so a vocab shard caps its own columns)."""
        out = self.lm_head(hidden)
        cap = self.args.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def hidden_static(
        self,
        input_ids: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """forward_static without the LM head: the final norm's output [B, T, hidden] (a
        long prompt's chunks need logits at one position at most: PrefillRunner)."""
        batch = ExtendBatch.build(
            block_table,
            start_pos,
            n_valid,
            input_ids.shape[1],
            kv_len,
            self.block_size,
            self.num_blocks,
        )
        input_ids = torch.where(batch.valid, input_ids, torch.zeros_like(input_ids))  # any pad
        dtype = self.model.norm.weight.dtype
        cos, sin = self.rotary_emb(batch.positions, dtype)  # [B, T, D]
        tables = {t: emb(batch.positions, dtype) for t, emb in self.rotary_by_type.items()}
        return self.model(input_ids, cos, sin, batch, tables)  # [B, T, hidden]

    @torch.no_grad()
    def forward_extend(
        self, input_ids: torch.Tensor, rows, start_pos: torch.Tensor, n_valid: torch.Tensor
    ) -> torch.Tensor:
        """See runtime.models.arch.base.CausalLM.forward_extend (rows: block tables)."""
        return self(input_ids, rows, start_pos, n_valid)


if TYPE_CHECKING:  # the type checker's proof that our model is a PagedModel
    _paged: type[PagedModel] = LlamaForCausalLM
