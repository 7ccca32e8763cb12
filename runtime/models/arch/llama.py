"""Llama-family decoder with HF-identical parameter names: Llama, Mistral, Qwen2, and the
families that differ from it as data (model_args: QK_NORM, NORM_PLACEMENT, GEMMA, ...): Qwen3,
OLMo 2, Phi-3 (its fused qkv_proj / gate_up_proj are split on load: loading.fused_tensors),
Gemma 2 and Gemma 3 text (four (1 + w) norms a layer, GeGLU, scaled embeddings, per-layer
attention scale / soft-cap, a RoPE table per layer type, final logit soft-capping).

This module holds the model around its layers (runtime.models.arch.decoder_layer): the
embeddings, the layer stack, the final norm and the LM head, the RoPE tables and the paged
KV cache's allocation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from runtime.models.arch.base import PagedModel, check_extend_args
from runtime.models.arch.cache import ExtendBatch, as_block_table, blocks_for
from runtime.models.arch.decoder_layer import DecoderLayer, add_then_norm
from runtime.models.arch.model_args import ModelArgs
from runtime.models.arch.norms import norm_class
from runtime.models.arch.rope import RotaryEmbedding, compute_inv_freq

if TYPE_CHECKING:
    from parallel.groups import TPInfo
    from parallel.layers import Shard


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
