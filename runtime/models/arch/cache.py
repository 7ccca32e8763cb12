"""Slot-based KV cache and the per-call batch layout shared by all layers.

Each attention layer owns one KVCache. A slot is one sequence; the caller keeps its length.
Rollback needs no work here: positions >= start_pos of a slot are simply overwritten by the
next forward_extend before any query can attend to them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one layer for `num_slots` sequences of up to `max_seq_len` tokens.

    Storage is [num_slots, n_kv_heads, max_seq_len + 1, head_dim]: one slot's heads are
    contiguous runs of positions, so a batch of slots 0..B-1 reads its keys as a plain view
    (no gather) that matmul takes as one strided batch. Position max_seq_len of every slot is
    scratch space that absorbs the padding tokens of a ragged batch, so writing needs no host
    sync and never touches valid data.
    """

    def __init__(self, num_slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        shape = self.shape(num_slots, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)

    @staticmethod
    def shape(num_slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int
              ) -> tuple[int, int, int, int]:
        """Shape of k_cache and of v_cache (a scratch position per slot included)."""
        return (num_slots, n_kv_heads, max_seq_len + 1, head_dim)

    def read(self, batch: "ExtendBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's keys and values [B, Hkv, L, D], L = kv_len: views for slots 0..B-1,
        else gathers. (Writing is fused with RoPE: runtime.models.arch.fused.rotary_write.)"""
        if batch.contiguous:
            rows = batch.slots.shape[0]
            return (self.k_cache[:rows, :, : batch.kv_len],
                    self.v_cache[:rows, :, : batch.kv_len])
        return (self.k_cache[batch.slots, :, : batch.kv_len],
                self.v_cache[batch.slots, :, : batch.kv_len])


@dataclass
class ExtendBatch:
    """Layout of one forward_extend call, computed once and shared by every layer."""
    slots: torch.Tensor        # [B] cache slot of each row
    positions: torch.Tensor    # [B, T] absolute position of each token
    valid: torch.Tensor        # [B, T] bool, t < n_valid[b]
    write_slots: torch.Tensor  # [B*T] cache slot of each token
    write_pos: torch.Tensor    # [B*T] cache position of each token (scratch for padding)
    kv_len: int                # attend over cache positions [0, kv_len)
    contiguous: bool = False   # slots == 0..B-1: read the cache without a gather
    _derived: dict = field(default_factory=dict, repr=False)   # masks, int32 rows: built once

    @classmethod
    def build(cls, slots: torch.Tensor, start_pos: torch.Tensor, n_valid: torch.Tensor,
              seq_len: int, kv_len: int, max_seq_len: int, contiguous: bool = False
              ) -> "ExtendBatch":
        offsets = torch.arange(seq_len, device=start_pos.device)           # [T]
        positions = start_pos[:, None] + offsets[None, :]                  # [B, T]
        valid = offsets[None, :] < n_valid[:, None]                        # [B, T]
        write_pos = torch.where(valid, positions, torch.full_like(positions, max_seq_len))
        write_slots = slots[:, None].expand_as(positions)                  # [B, T]
        return cls(slots=slots, positions=positions, valid=valid,
                   write_slots=write_slots.flatten(), write_pos=write_pos.flatten(),
                   kv_len=kv_len, contiguous=contiguous)

    def int32_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, valid) as contiguous int32 [B, T]: what the Triton attention kernel
        reads, converted once per call for all the layers (two kernels fewer per layer)."""
        if "int32" not in self._derived:
            self._derived["int32"] = (self.positions.to(torch.int32).contiguous(),
                                      self.valid.to(torch.int32).contiguous())
        return self._derived["int32"]

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Boolean attention mask [B, 1, T, L]: causal, optionally a sliding window of `window`
        positions ending at the query (transformers: kv > q - window)."""
        if window not in self._derived:
            kv_pos = torch.arange(self.kv_len, device=self.positions.device)  # [L]
            q_pos = self.positions[:, :, None]                                # [B, T, 1]
            allowed = kv_pos[None, None, :] <= q_pos                          # [B, T, L]
            if window is not None:
                allowed = allowed & (kv_pos[None, None, :] > q_pos - window)
            # padding queries see position 0 so that no softmax row is empty (no NaN)
            allowed = allowed | (~self.valid[:, :, None] & (kv_pos == 0)[None, None, :])
            self._derived[window] = allowed[:, None]                         # [B, 1, T, L]
        return self._derived[window]
