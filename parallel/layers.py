"""Tensor-parallel layers that replace a model's nn.Linear / nn.Embedding (Megatron-LM style).

Each is a subclass of the module it replaces, so parameter names stay the checkpoint's
(`q_proj.weight`, ...) and the model code needs no change. Each holds only its rank's shard,
knows which slice of the checkpoint tensor that is (`shards()`, read by the loader), and does
its own communication with the group it was given. Built on the meta device by a
model's own plan (its apply_tp); weights are loaded afterwards. Inference only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.mappings import all_gather_last_dim, all_reduce


class Shard(NamedTuple):
    """Rows [start, stop) of a checkpoint tensor along `dim`. `stop` may lie past the tensor's
    end: the missing rows are zeros (padding of the last vocab shard)."""

    dim: int
    start: int
    stop: int


class ColumnParallelLinear(nn.Linear):
    """Output features [out_start, out_stop) of a Linear (bias split the same way). Each rank's
    output is its own slice; no communication."""

    def __init__(
        self,
        in_features: int,
        out_start: int,
        out_stop: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_features, out_stop - out_start, bias=bias, device=device, dtype=dtype)
        self.out_start, self.out_stop = out_start, out_stop

    def shards(self) -> dict[str, Shard]:
        out = {"weight": Shard(0, self.out_start, self.out_stop)}
        if self.bias is not None:
            out["bias"] = Shard(0, self.out_start, self.out_stop)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, out_slice=[{self.out_start}, {self.out_stop})"


class RowParallelLinear(nn.Linear):
    """Input features [in_start, in_stop) of a Linear, then a sum over the group. The bias is
    replicated and added once, after the all-reduce."""

    def __init__(
        self,
        in_start: int,
        in_stop: int,
        out_features: int,
        bias: bool,
        group: dist.ProcessGroup | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_stop - in_start, out_features, bias=bias, device=device, dtype=dtype)
        self.in_start, self.in_stop = in_start, in_stop
        self.group = group

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(1, self.in_start, self.in_stop)}  # bias: whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_slice=[{self.in_start}, {self.in_stop})"


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_stop) of the embedding. Ids outside the slice give zeros; the
    all-reduce adds the one rank's row that holds each id. `vocab_stop` may exceed
    `vocab_size` (the last shard is padded with zero rows that no id ever selects)."""

    def __init__(
        self,
        vocab_start: int,
        vocab_stop: int,
        vocab_size: int,
        embedding_dim: int,
        group: dist.ProcessGroup | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        rows = vocab_stop - vocab_start  # uninitialised, as the model's own embedding
        super().__init__(
            rows,
            embedding_dim,
            _weight=torch.empty(rows, embedding_dim, device=device, dtype=dtype),
        )
        self.vocab_start, self.vocab_stop, self.vocab_size = vocab_start, vocab_stop, vocab_size
        self.group = group

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.vocab_start, self.vocab_stop)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, vocab_slice=[{self.vocab_start}, {self.vocab_stop}), "
            f"vocab_size={self.vocab_size}"
        )


class ParallelLMHead(nn.Linear):
    """Column-parallel output projection over the (padded) vocab: rows [vocab_start,
    vocab_stop) of lm_head (with tied embeddings: the same Parameter as the embedding shard).

    gather_logits=True: all-gather, drop the padding; every rank returns [..., vocab_size].
    gather_logits=False: this rank's slice [..., vocab_stop - vocab_start] of the padded vocab,
    columns >= vocab_size (padding) set to -inf, for vocab-parallel sampling later."""

    def __init__(
        self,
        hidden_size: int,
        vocab_start: int,
        vocab_stop: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        gather_logits: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            hidden_size, vocab_stop - vocab_start, bias=False, device=device, dtype=dtype
        )
        self.vocab_start, self.vocab_stop, self.vocab_size = vocab_start, vocab_stop, vocab_size
        self.group = group
        self.gather_logits = gather_logits

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.vocab_start, self.vocab_stop)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # [..., V_local]
        if self.gather_logits:
            full = all_gather_last_dim(logits, self.group)  # [..., V_padded]
            if full.shape[-1] != self.vocab_size:
                full = full[..., : self.vocab_size].contiguous()
            return full
        real = max(0, min(self.vocab_stop, self.vocab_size) - self.vocab_start)
        if real < logits.shape[-1]:
            logits[..., real:] = float("-inf")
        return logits

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, vocab_slice=[{self.vocab_start}, {self.vocab_stop}), "
            f"vocab_size={self.vocab_size}, gather_logits={self.gather_logits}"
        )


class ParallelRMSNorm(nn.Module):
    """An RMSNorm over a feature dim split across the group (e.g. OLMo 2's q/k norms over all
    heads, each rank holding features [start, stop)): the sum of squares is all-reduced, so
    each rank normalises its slice by the whole row's RMS. The mean divides by local size x
    group size, which is also right when every rank holds an equal share of replicated
    features (KV heads replicated r times: r x the sum over r x the features)."""

    def __init__(
        self,
        start: int,
        stop: int,
        eps: float,
        group: dist.ProcessGroup | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(stop - start, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.start, self.stop, self.group = start, stop, group

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.stop)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # [..., local]
        total = all_reduce(h.pow(2).sum(-1, keepdim=True), self.group)
        count = h.shape[-1] * (1 if self.group is None else dist.get_world_size(self.group))
        h = h * torch.rsqrt(total / count + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"slice=[{self.start}, {self.stop}), eps={self.variance_epsilon}"
