"""Rank 0's KV block books: which blocks of the pool each request holds, how many requests
hold each block, and the prefix index of full blocks whose contents are known.

The workers hold the pages (one pool per model, draft and target with the same number of
blocks, runtime.models.arch.cache.KVCache); this class holds every fact about them, and the
scheduler sends each request's table (and its growth) with the commands. A block is

- free: held by nobody and indexed by nothing (`_free`, taken first);
- cached: held by nobody but indexed (`_cached`, least recently freed first): its KV still
  serves a prefix match until it is evicted to become some request's new block;
- held: reference count > 0 (prefix-matched blocks are held by every request that mapped
  them; only full blocks are ever shared, and nobody writes a full block again).

Prefix index: a full block's key is a 128-bit digest of its parent's key and its tokens (a
chain: it names every token before it too). Only tokens that are committed *and* cached on
every rank are indexed (`register`): a rejected draft token never is.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

ROOT = b""  # the parent key of a sequence's first block


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    """The index key of a full block of `tokens` after the blocks whose last key is `parent`."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class BlockTable:
    """One request's blocks in order (position p lives in blocks[p // block_size]) and the
    keys of its leading blocks that are indexed (len(keys) <= len(blocks))."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()

    # --- counts ------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks a request may take now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks held by requests (0 when none runs)."""
        return self.num_blocks - self.available

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # --- prefix matching ------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks of the longest indexed prefix of `tokens` (whole blocks, held by
        nobody new yet): what a request starting with these tokens need not prefill."""
        if not self.prefix_caching:
            return []
        blocks, parent = [], ROOT
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = chain_key(parent, tokens[start : start + self.block_size])
            block = self.index.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cost(self, matched: list[int], positions: int) -> int:
        """Blocks a new request would take from `available`: its new blocks for `positions`
        and the matched ones that are cached now (held by nobody)."""
        fresh = max(0, self.blocks_for(positions) - len(matched))
        return fresh + sum(1 for b in matched if self.refs[b] == 0)

    def start(self, matched: list[int], positions: int) -> BlockTable:
        """A request's table: the matched blocks (held once more), then new blocks up to
        `positions` (cost() must fit in available)."""
        table = BlockTable()
        parent = ROOT
        for block in matched:
            self._hold(block)
            key = self.key_of[block]
            assert key is not None  # a matched block is indexed
            parent = key
            table.blocks.append(block)
            table.keys.append(parent)
        self.grow(table, positions)
        return table

    # --- growth and release -----------------------------------------------------------------
    def grow(self, table: BlockTable, positions: int) -> list[int]:
        """New blocks so that `table` addresses `positions`; returns them (nothing when it
        does already). MemoryError when too few are available (the caller checks first)."""
        need = self.blocks_for(positions) - len(table.blocks)
        if need <= 0:
            return []
        if need > self.available:
            raise MemoryError(f"{need} KV blocks asked for, {self.available} available")
        new = [self._take() for _ in range(need)]
        table.blocks.extend(new)
        return new

    def register(self, table: BlockTable, tokens: list[int], cached: int) -> None:
        """Index the table's full blocks among the first `cached` positions, whose KV is
        known on every rank to hold `tokens` (committed tokens). A block whose key is
        already indexed elsewhere stays unindexed (its twin serves the matches)."""
        if not self.prefix_caching:
            return
        full = min(cached, len(tokens)) // self.block_size
        parent = table.keys[-1] if table.keys else ROOT
        for i in range(len(table.keys), min(full, len(table.blocks))):
            start = i * self.block_size
            parent = chain_key(parent, tokens[start : start + self.block_size])
            block = table.blocks[i]
            if parent not in self.index and self.key_of[block] is None:
                self.index[parent] = block
                self.key_of[block] = parent
            table.keys.append(parent)

    def free(self, table: BlockTable) -> None:
        """Give back every block of the table: indexed ones stay cached, the others become
        free. Last blocks first: eviction takes a chain's tail before its head, which every
        longer match needs."""
        for block in reversed(table.blocks):
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than held")
            if self.refs[block] == 0:
                if self.key_of[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        table.blocks.clear()
        table.keys.clear()

    # --- internals ----------------------------------------------------------------------------
    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self._cached.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        """A block for new KV: a free one, else the least recently cached one (unindexed)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            key = self.key_of[block]
            assert key is not None  # a cached block is indexed
            del self.index[key]
            self.key_of[block] = None
        self.refs[block] = 1
        return block
