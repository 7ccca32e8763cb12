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

    Storage is flat, [num_slots * max_seq_len + 1, n_kv_heads, head_dim]: row
    slot * max_seq_len + pos holds (slot, pos) and the last row is scratch space that absorbs the
    padding tokens of a ragged batch, so writing needs no host sync and never touches valid data.
    """

    def __init__(self, num_slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        rows = num_slots * max_seq_len + 1
        shape = (rows, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)

    @property
    def scratch_row(self) -> int:
        return self.num_slots * self.max_seq_len

    def _slots_view(self, buf: torch.Tensor) -> torch.Tensor:
        # [num_slots, max_seq_len, Hkv, D] view without the scratch row
        return buf[: self.scratch_row].view(self.num_slots, self.max_seq_len, *buf.shape[1:])

    def update(self, batch: "ExtendBatch", k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, D]; return this batch's keys/values [B, L, Hkv, D], L = kv_len."""
        idx = (batch.write_rows,)                                        # [B*T]
        self.k_cache.index_put_(idx, k.flatten(0, 1).to(self.k_cache.dtype))
        self.v_cache.index_put_(idx, v.flatten(0, 1).to(self.v_cache.dtype))
        k_all = self._slots_view(self.k_cache)[batch.slots, : batch.kv_len]
        v_all = self._slots_view(self.v_cache)[batch.slots, : batch.kv_len]
        return k_all, v_all


@dataclass
class ExtendBatch:
    """Layout of one forward_extend call, computed once and shared by every layer."""
    slots: torch.Tensor        # [B] cache slot of each row
    positions: torch.Tensor    # [B, T] absolute position of each token
    valid: torch.Tensor        # [B, T] bool, t < n_valid[b]
    write_rows: torch.Tensor   # [B*T] flat cache row of each token (scratch row for padding)
    kv_len: int                # attend over cache positions [0, kv_len)
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, slots: torch.Tensor, start_pos: torch.Tensor, n_valid: torch.Tensor,
              seq_len: int, kv_len: int, max_seq_len: int, num_slots: int) -> "ExtendBatch":
        offsets = torch.arange(seq_len, device=start_pos.device)           # [T]
        positions = start_pos[:, None] + offsets[None, :]                  # [B, T]
        valid = offsets[None, :] < n_valid[:, None]                        # [B, T]
        rows = slots[:, None] * max_seq_len + positions                    # [B, T]
        rows = torch.where(valid, rows, torch.full_like(rows, num_slots * max_seq_len))
        return cls(slots=slots, positions=positions, valid=valid,
                   write_rows=rows.flatten(), kv_len=kv_len)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Boolean attention mask [B, 1, T, L]: causal, optionally a sliding window of `window`
        positions ending at the query (transformers: kv > q - window)."""
        if window not in self._masks:
            kv_pos = torch.arange(self.kv_len, device=self.positions.device)  # [L]
            q_pos = self.positions[:, :, None]                                # [B, T, 1]
            allowed = kv_pos[None, None, :] <= q_pos                          # [B, T, L]
            if window is not None:
                allowed = allowed & (kv_pos[None, None, :] > q_pos - window)
            # padding queries see position 0 so that no softmax row is empty (no NaN)
            allowed = allowed | (~self.valid[:, :, None] & (kv_pos == 0)[None, None, :])
            self._masks[window] = allowed[:, None]                           # [B, 1, T, L]
        return self._masks[window]
