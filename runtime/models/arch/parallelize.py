"""The Llama-family model's tensor-parallel plan: Megatron-style, applied from outside it.

`apply_tp(model, tp)` (cf. gpt-fast's `apply_tp(model)`, torchtitan's `apply_tp(model, mesh)`)
takes a LlamaForCausalLM built on the meta device (runtime.models.loading.loader.build_model),
before
its weights are loaded, and swaps its layers for the generic tensor-parallel ones of
parallel.layers (this plan lives beside the model, as torchtitan's parallelize.py does):

- q/k/v_proj, gate/up_proj: column-parallel (output features and biases split);
- o_proj, down_proj: row-parallel (input features split), all-reduce, then the (whole) bias;
- embed_tokens: vocab-parallel (each rank a vocab slice, other ids masked to zero, all-reduce);
- lm_head: column-parallel over the vocab, all-gathered so every rank's forward_extend returns
  the full [B, T, V] logits. With gather_logits=False each rank returns only its vocab slice
  [B, T, V_padded / size] (padding columns -inf), for vocab-parallel sampling later. With tied
  embeddings lm_head shares the embedding shard (same vocab slice, same Parameter).

Attention heads: each rank gets n_heads / size consecutive query heads (n_heads must divide
by the TP size). KV heads are split the same way when n_kv_heads divides by the TP size; when
the TP size is a multiple of n_kv_heads, each KV head is replicated onto size / n_kv_heads
ranks, so every rank holds the one KV head its query heads use. The attention module's
n_heads / n_kv_heads become the local counts, so allocate_cache sizes the KV cache per rank.

Vocab: each rank holds ceil(V / size) rows; when V does not divide by the size, the last shard
is padded with zero rows (no id selects them, their logits are cut off after the gather), so
the logits keep exactly the checkpoint's V columns. The MLP's intermediate features are split
as evenly as possible (shards may differ by one). Norms, RoPE and biases of row-parallel
layers are replicated. Q/k norms over each head (Qwen3) are replicated too; those over the
whole projection (OLMo 2) become parallel.layers.ParallelRMSNorm, sharded with the heads,
whose RMS sums the squares over the group (one small all-reduce each).

The loader reads, per parameter, only the slice listed in `model.tp_shards`. Collectives run
over the explicitly passed group (parallel.mappings); nothing is global. Inference only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel.groups import TPInfo
from parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    ParallelRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.models.arch.llama import LlamaForCausalLM
from runtime.models.arch.model_args import ModelArgs, check_tp_shape

__all__ = ["SHARDED", "TPPlan", "apply_tp", "plan_tp"]

# the classes apply_tp swaps in, each holding a slice of a checkpoint tensor (their shards())
SHARDED = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    ParallelLMHead,
    ParallelRMSNorm,
)


@dataclass(frozen=True)
class TPPlan:
    """Which slice of each dimension one rank holds. Ranges are [start, stop)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    kv_replicas: int  # ranks holding each KV head (1 when the KV heads are split)
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # in the padded vocab; stop may exceed vocab_size
    padded_vocab: int

    @property
    def n_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _model_name(args: ModelArgs) -> str:
    path = getattr(args.hf_config, "name_or_path", None) or getattr(
        args.hf_config, "_name_or_path", None
    )
    return f"{args.model_type} model {path!r}" if path else f"{args.model_type} model"


def plan_tp(args: ModelArgs, rank: int, size: int) -> TPPlan:
    """Rank `rank`'s slices for TP size `size`; ValueError when the heads do not split."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} of size {size}")
    n_heads, n_kv = args.n_heads, args.n_kv_heads
    check_tp_shape(_model_name(args), n_heads, n_kv, size)
    heads = n_heads // size
    group = n_heads // n_kv  # query heads per KV head
    if n_kv % size == 0:
        replicas = 1
        kv_local = n_kv // size
        kv_start = rank * kv_local
    else:  # size > n_kv: replicate each KV head
        replicas = size // n_kv
        kv_local = 1
        kv_start = rank // replicas
    q_start = rank * heads
    # the rank's query heads must use exactly its KV heads (true by construction; checked)
    last_kv = (q_start + heads - 1) // group
    assert q_start // group == kv_start and last_kv == kv_start + kv_local - 1
    inter = args.intermediate_size
    per_vocab = -(-args.vocab_size // size)
    return TPPlan(
        rank=rank,
        size=size,
        q_heads=(q_start, q_start + heads),
        kv_heads=(kv_start, kv_start + kv_local),
        kv_replicas=replicas,
        intermediate=(inter * rank // size, inter * (rank + 1) // size),
        vocab=(rank * per_vocab, (rank + 1) * per_vocab),
        padded_vocab=per_vocab * size,
    )


def apply_tp(model: LlamaForCausalLM, tp: TPInfo | None, *, gather_logits: bool = True) -> None:
    """Shard `model` (on the meta device, weights not yet loaded) for rank tp.rank of
    tp.size, in place. No-op for tp None or size 1. Then load with
    runtime.models.loading.loader.load_weights, which reads only this rank's slices. See the
    module docstring.

    Sets on the model: `tp` (the TPInfo), `tp_plan` (TPPlan: this rank's head / feature /
    vocab ranges) and `tp_shards` (parameter name -> Shard of the checkpoint tensor)."""
    if tp is None or not tp.enabled:
        return
    if getattr(model, "tp", None) is not None:
        raise RuntimeError("apply_tp was already applied to this model")
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError(
            "apply_tp shards a model built on the meta device "
            "(runtime.models.loading.loader.build_model) before its weights are loaded"
        )
    tp.check_group()
    args, group = model.args, tp.group
    plan = plan_tp(args, tp.rank, tp.size)
    meta = torch.device("meta")
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        (q0, q1), (k0, k1), (i0, i1) = plan.q_heads, plan.kv_heads, plan.intermediate
        attn.q_proj = _column(attn.q_proj, q0 * d, q1 * d, meta)
        attn.k_proj = _column(attn.k_proj, k0 * d, k1 * d, meta)
        attn.v_proj = _column(attn.v_proj, k0 * d, k1 * d, meta)
        attn.o_proj = _row(attn.o_proj, q0 * d, q1 * d, group, meta)
        attn.n_heads, attn.n_kv_heads = plan.n_heads, plan.n_kv_heads
        if attn.qk_norm == "full":
            eps = args.rms_norm_eps  # that of the norms replaced
            attn.q_norm = ParallelRMSNorm(q0 * d, q1 * d, eps, group, device=meta)
            attn.k_norm = ParallelRMSNorm(k0 * d, k1 * d, eps, group, device=meta)
        mlp.gate_proj = _column(mlp.gate_proj, i0, i1, meta)
        mlp.up_proj = _column(mlp.up_proj, i0, i1, meta)
        mlp.down_proj = _row(mlp.down_proj, i0, i1, group, meta)
    v0, v1 = plan.vocab
    model.model.embed_tokens = VocabParallelEmbedding(
        v0, v1, args.vocab_size, args.hidden_size, group, device=meta
    )
    model.lm_head = ParallelLMHead(
        args.hidden_size, v0, v1, args.vocab_size, group, gather_logits=gather_logits, device=meta
    )
    model.tie_weights()  # tied: lm_head shares the embedding's vocab shard
    model.tp_shards = {
        f"{module_name}.{param}": shard
        for module_name, module in model.named_modules()
        if isinstance(module, SHARDED)
        for param, shard in module.shards().items()
    }
    model.tp = tp
    model.tp_plan = plan


def _column(linear: nn.Linear, start: int, stop: int, device) -> ColumnParallelLinear:
    return ColumnParallelLinear(
        linear.in_features, start, stop, linear.bias is not None, device=device
    )


def _row(linear: nn.Linear, start: int, stop: int, group, device) -> RowParallelLinear:
    return RowParallelLinear(
        start, stop, linear.out_features, linear.bias is not None, group, device=device
    )
