"""A vocab-parallel target's logits: this rank holds [vocab_start, vocab_stop) of a vocabulary
padded to a multiple of the TP size (see parallel/layers.py ParallelLMHead)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.mappings import all_gather_last_dim, vocab_parallel_argmax


@dataclass(frozen=True)
class VocabParallel:
    group: dist.ProcessGroup
    vocab_start: int
    vocab_size: int  # the checkpoint's (unpadded) vocabulary

    @classmethod
    def of(cls, model, group: dist.ProcessGroup) -> VocabParallel:
        head = model.lm_head
        return cls(group, head.vocab_start, head.vocab_size)

    def argmax(self, local: torch.Tensor) -> torch.Tensor:
        """[..., V_local] -> [...] global token ids (ties: lowest id)."""
        return vocab_parallel_argmax(local, self.vocab_start, self.group)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[..., V_local] -> [..., vocab_size] full logits on every rank."""
        return all_gather_last_dim(local, self.group)[..., : self.vocab_size]
