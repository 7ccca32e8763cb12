"""Tensor-parallel collectives (Megatron-LM tensor_parallel/mappings.py style, inference only).

Every collective takes its process group explicitly and is a no-op when the group is None or
has one member, so the same layer code runs with and without tensor parallelism. There is no
module-global group state. Both NCCL (GPU) and gloo (CPU) work. No autograd rules: these are
for inference (callers run under torch.no_grad()).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Members of `group`; 1 for None (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of `x` over the group, in place; returns x. No-op for a group of size <= 1."""
    if group_size(group) == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenation along the last dim of every member's `x` (same shape on all), in group
    rank order: [..., n] -> [..., size * n]. No-op for a group of size <= 1."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    if dist.get_backend(group) == dist.Backend.NCCL:
        # one flat collective: out[r] = rank r's x, then move the rank dim next to the last
        out = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])
    parts = [torch.empty_like(x) for _ in range(size)]  # gloo: list all_gather, then cat
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_argmax(
    local: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Global argmax over a vocab-parallel last dim without gathering the vocabulary.

    local: [..., V_local] this rank's logits for vocab ids [vocab_start, vocab_start + V_local)
    (padding columns are -inf). Returns [...] int64 global ids, identical on every rank; ties
    go to the lowest id, as torch.argmax over the full vocabulary does. Moves 2 numbers per
    position instead of V_local."""
    value, index = local.max(dim=-1)  # [...], first max
    index = index + vocab_start
    size = group_size(group)
    if size == 1:
        return index
    values = [torch.empty_like(value) for _ in range(size)]
    indices = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    best = torch.stack(values).argmax(dim=0)  # [...] lowest rank wins
    return torch.stack(indices).gather(0, best[None]).squeeze(0)
