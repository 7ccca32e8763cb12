"""The block tables a shard passes with each forward: for now each slot's fixed table.

Until rank 0 owns the block books (issue 35: allocation, reference counts, prefix index),
slot s addresses blocks s * M .. s * M + M - 1 of both models' pools (M = the model's
blocks_per_seq: ceil((max_seq_len + draft room) / kv_block_size); the mapping itself is
runtime.models.arch.cache.slot_block_table). This class is what the block manager replaces:
the model and the runners take block tables and never see a slot.
"""
from __future__ import annotations

import torch

from runtime.models.arch.cache import slot_block_table
from runtime.models.runners.hostcopy import to_device

MEMO = 256   # slot lists whose tables are kept on the device (rounds repeat their slots)


class FixedBlockTables:
    def __init__(self, num_slots: int, blocks_per_seq: int, device: torch.device):
        self.device = device
        self.all = to_device(slot_block_table(range(num_slots), blocks_per_seq), torch.int32,
                             device)                                        # [S, M]
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def rows(self, slots: list[int]) -> torch.Tensor:
        """int32 [B, M] on the device: the slots' tables. The same tensor for the same slot
        list (runners then skip copying it into their graphs' input buffer)."""
        key = tuple(slots)
        table = self._memo.get(key)
        if table is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            if list(key) == list(range(len(key))):
                table = self.all[: len(key)]
            else:
                index = to_device(list(key), torch.long, self.device)
                table = self.all.index_select(0, index)
            self._memo[key] = table
        return table
