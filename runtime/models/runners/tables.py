"""Block tables for the static-shape runners: the rows' tables on the device, and the static
input buffer a CUDA graph reads them from (one graph serves every table)."""

from __future__ import annotations

import torch

from runtime.models.arch.base import PagedModel
from runtime.models.arch.cache import as_block_table, slot_block_table
from runtime.models.runners.hostcopy import to_device


def device_table(rows, blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    """rows: block tables [B, M] (a tensor, best already int32 on the device: no copy; or
    lists), or slots [B] (their fixed tables, cache.slot_block_table) -> int32 [B, M] on
    `device`. Lists go through pinned memory (hostcopy: no host sync)."""
    if isinstance(rows, torch.Tensor):
        return as_block_table(rows, blocks_per_seq, device)
    rows = list(rows)
    if rows and isinstance(rows[0], int):
        rows = slot_block_table(rows, blocks_per_seq)
    return to_device(rows, torch.int32, device)


class StaticTable:
    """The block-table input of a runner's graphs: [max_batch, M] int32 on the device, M the
    model's blocks_per_seq, first filled with the scratch block (padding rows read nothing
    and write only the scratch block, whatever their entries)."""

    def __init__(self, model: PagedModel, max_batch: int, device: torch.device):
        self.blocks_per_seq, self.device = model.blocks_per_seq, device
        self.buffer = torch.full(
            (max_batch, model.blocks_per_seq), model.num_blocks, dtype=torch.int32, device=device
        )
        self._last: torch.Tensor | tuple | None = None  # what the buffer holds

    def load(self, rows) -> None:
        """Copy the rows' tables into the buffer's first rows. What the buffer already holds
        is not copied again: a device tensor passed again (the same object: tables are
        values, never changed in place), or the same slot list."""
        key = rows if isinstance(rows, torch.Tensor) else tuple(rows)
        if key is self._last or (
            isinstance(key, tuple) and isinstance(self._last, tuple) and key == self._last
        ):
            return
        table = device_table(rows, self.blocks_per_seq, self.device)
        self.buffer[: table.shape[0]].copy_(table, non_blocking=True)
        slots = isinstance(key, tuple) and (not key or isinstance(key[0], int))
        self._last = key if slots or key is table else None

    def rows(self, bsz: int) -> torch.Tensor:
        """The buffer's first bsz rows (a view)."""
        return self.buffer[:bsz]
