"""The interfaces of the models behind a worker (CausalLM; PagedModel, the capability of ours),
and forward_extend's argument checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol, TypeGuard, runtime_checkable

import torch
from torch import nn

from runtime.models.arch.model_args import ModelArgs


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    # whether this is a PagedModel: said by its class, never probed (is_paged)
    paged: ClassVar[bool]

    def allocate_cache(self, num_slots: int, max_seq_len: int) -> None: ...

    def forward_extend(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids [B, T] right-padded, start_pos/n_valid [B] -> logits [B, T, V]. rows:
        the rows' block tables [B, M] (paged models: LlamaForCausalLM; slots [B] stand for
        their fixed tables, cache.slot_block_table), or slots [B] (the transformers
        fallback, which keeps a cache per slot).

        Row b's cache at positions >= start_pos[b] is discarded, then the tokens
        input_ids[b, :n_valid[b]] are written at start_pos[b] ...; the query at position p
        attends to positions [0, p] of its row. Rows t >= n_valid[b] are undefined."""
        ...

    def free_slot(self, slot: int) -> None: ...


class PagedModel(CausalLM, Protocol):
    """A CausalLM over a paged KV cache (runtime.models.arch.llama.LlamaForCausalLM, `paged`
    True): block pools shared by every row, rows read and written through block tables, and
    static-shape forwards that the runners (runtime.models.runners) pad, bucket and capture
    as CUDA graphs. What a model without it (the transformers fallback) gets instead: one
    eager forward_extend over slots, the model keeping its own cache per slot."""

    args: ModelArgs
    max_seq_len: int | None  # set by allocate_cache, as the sizes below
    block_size: int  # positions per KV block
    blocks_per_seq: int  # a block table's width: ceil(max_seq_len / block_size)
    num_blocks: int  # the pool's blocks; block id num_blocks is the scratch block

    def allocate_cache(
        self,
        num_slots: int,
        max_seq_len: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_dtype: str = "auto",
    ) -> None: ...

    def forward_static(
        self,
        input_ids: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """forward_extend without checks or host synchronisation, at shapes that depend only
        on input_ids.shape, block_table.shape and kv_len: logits [B, T, V]."""
        ...

    def hidden_static(
        self,
        input_ids: torch.Tensor,
        block_table: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """forward_static without the LM head: hidden states [B, T, hidden]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head of hidden states [..., hidden] -> [..., V]."""
        ...

    def modules(self) -> Iterator[nn.Module]: ...


def is_paged(model: CausalLM) -> TypeGuard[PagedModel]:
    """Whether `model` is a PagedModel: its class says so (CausalLM.paged)."""
    return model.paged


def check_extend_args(
    input_ids: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    n_valid: torch.Tensor,
    num_slots: int | None,
    max_seq_len: int | None,
) -> int:
    """Validate forward_extend arguments with one host sync; return max(start_pos + n_valid).
    `slots` [B] in 0..num_slots-1, or block tables [B, M] in 0..num_slots-1 (num_slots then
    counts blocks); max_seq_len: the most positions a row may hold.

    Distinctness of `slots` (of blocks across rows) is the caller's contract: not checked."""
    if num_slots is None or max_seq_len is None:
        raise RuntimeError("allocate_cache() must be called before forward_extend()")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    bsz, seq = input_ids.shape
    for name, t in (("slots", slots), ("start_pos", start_pos), ("n_valid", n_valid)):
        if tuple(t.shape[: 1 if t is slots else None]) != (bsz,):
            raise ValueError(f"{name} must have shape [{bsz}], got {tuple(t.shape)}")
    if bsz == 0:
        raise ValueError("empty batch")
    end = start_pos + n_valid
    kv_len, min_start, min_n, max_n, min_slot, max_slot = torch.stack(
        [
            end.max(),
            start_pos.min(),
            n_valid.min(),
            n_valid.max(),
            slots.min().long(),
            slots.max().long(),
        ]
    ).tolist()
    if min_slot < 0 or max_slot >= num_slots:
        what = "block" if slots.dim() == 2 else "slot"
        raise ValueError(f"{what} out of range 0..{num_slots - 1}: {slots.tolist()}")
    if min_start < 0:
        raise ValueError(f"negative start_pos: {start_pos.tolist()}")
    if min_n < 0 or max_n > seq:
        raise ValueError(f"n_valid must be in 0..{seq}: {n_valid.tolist()}")
    if kv_len > max_seq_len:
        raise ValueError(
            f"position {kv_len - 1} exceeds the KV cache (max_seq_len "
            f"{max_seq_len}): start_pos {start_pos.tolist()}, "
            f"n_valid {n_valid.tolist()}"
        )
    return int(kv_len)
