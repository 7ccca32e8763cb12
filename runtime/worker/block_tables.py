"""The block tables a shard passes with each forward: one per slot, as rank 0 sends them.

Rank 0 owns the block books (runtime.serving.block_manager): a prefill command gives each
new sequence its table, a round command the blocks each slot's table grows by. This class
only holds them: on the host (to check that a step writes inside its blocks) and on the
device ([S, M] int32, entries past a table's end pointing at the pool's scratch block), and
hands out the rows of a batch. A slot never given a table (a shard driven directly, as unit
tests do) has its fixed one, runtime.models.arch.cache.slot_block_table, when the pool holds
every slot's.
"""

from __future__ import annotations

import torch

from runtime.models.arch.cache import slot_block_table
from runtime.models.runners.hostcopy import to_device

MEMO = 256  # slot lists whose tables are kept on the device (rounds repeat their slots)


class SlotTables:
    def __init__(
        self,
        num_slots: int,
        blocks_per_seq: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ):
        self.width, self.num_blocks, self.block_size = blocks_per_seq, num_blocks, block_size
        self.device = device
        fixed = num_blocks >= num_slots * blocks_per_seq
        self._default = (
            (lambda s: slot_block_table([s], blocks_per_seq)[0]) if fixed else (lambda s: [])
        )
        self.host = [self._default(s) for s in range(num_slots)]
        self.all = torch.full(
            (num_slots, blocks_per_seq), num_blocks, dtype=torch.int32, device=device
        )  # [S, M]
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}
        self._write([(s, 0, t) for s, t in enumerate(self.host) if t])

    def capacity(self, slot: int) -> int:
        """Positions the slot's table addresses."""
        return len(self.host[slot]) * self.block_size

    def set(self, slots: list[int], tables: list[list[int]]) -> None:
        """New sequences' tables."""
        for slot, table in zip(slots, tables):
            self._check(slot, table, 0)
        changes = []
        for slot, table in zip(slots, tables):
            old = len(self.host[slot])
            self.host[slot] = list(table)
            changes.append((slot, 0, list(table) + [self.num_blocks] * max(0, old - len(table))))
        self._write(changes)

    def extend(self, slots: list[int], tables: list[list[int]]) -> None:
        """Blocks appended to these slots' tables."""
        changes = []
        for slot, new in zip(slots, tables):
            if new:
                self._check(slot, new, len(self.host[slot]))
                changes.append((slot, len(self.host[slot]), list(new)))
                self.host[slot].extend(new)
        self._write(changes)

    def reset(self, slots: list[int]) -> None:
        """These slots' sequences are over: their tables go back to the default."""
        self.set(slots, [self._default(s) for s in slots])

    def rows(self, slots: list[int]) -> torch.Tensor:
        """int32 [B, M] on the device: the slots' tables. The same tensor for the same slot
        list while no table changes (runners then skip copying it into their graphs' input
        buffer)."""
        key = tuple(slots)
        table = self._memo.get(key)
        if table is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            if list(key) == list(range(len(key))):
                table = self.all[: len(key)]
            else:
                table = self.all.index_select(0, to_device(list(key), torch.long, self.device))
            self._memo[key] = table
        return table

    def _check(self, slot: int, blocks: list[int], at: int) -> None:
        if not 0 <= slot < len(self.host):
            raise ValueError(f"slot {slot} out of range 0..{len(self.host) - 1}")
        if at + len(blocks) > self.width:
            raise ValueError(
                f"slot {slot}: a table of {at + len(blocks)} blocks exceeds {self.width}"
            )
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"slot {slot}: KV blocks {bad[:4]} out of range 0..{self.num_blocks - 1}"
            )

    def _write(self, changes: list[tuple[int, int, list[int]]]) -> None:
        """(slot, first column, blocks) entries into the device table, one copy for all."""
        if not changes:
            return
        self._memo.clear()
        rows = [s for s, at, blocks in changes for _ in blocks]
        cols = [at + i for s, at, blocks in changes for i in range(len(blocks))]
        values = [b for _, _, blocks in changes for b in blocks]
        index = to_device([rows, cols], torch.long, self.device)  # [2, n]
        self.all.index_put_((index[0], index[1]), to_device(values, torch.int32, self.device))
