"""Rank 0's KV block books (runtime.serving.block_manager.BlockManager): allocation, reference
counts, the chain-keyed prefix index of full committed blocks, LRU eviction tail first, and a
seeded churn of requests against the books' invariants."""

from __future__ import annotations

import random

import pytest

from runtime.serving.block_manager import ROOT, BlockManager, BlockTable, chain_key

pytestmark = pytest.mark.timeout(60)

BS = 4


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def keys_of(tokens: list[int], block_size: int = BS) -> list[bytes]:
    """The chain keys of every full block of `tokens`."""
    keys, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


def check_invariants(bm: BlockManager, tables: list[BlockTable]) -> None:
    """The books agree with themselves and with the live tables."""
    held: dict[int, int] = {}
    for table in tables:
        assert len(table.keys) <= len(table.blocks)
        for block in table.blocks:
            held[block] = held.get(block, 0) + 1
    # every reference is a live table's
    assert sum(bm.refs) == sum(len(t.blocks) for t in tables)
    for block in range(bm.num_blocks):
        assert bm.refs[block] == held.get(block, 0), block
    # free, cached and held partition the pool
    free, cached = set(bm._free), set(bm._cached)
    assert len(free) == len(bm._free) and len(cached) == len(bm._cached)
    held_set = set(held)
    assert not (free & cached) and not (free & held_set) and not (cached & held_set)
    assert free | cached | held_set == set(range(bm.num_blocks))
    assert bm.used == len(held_set)
    assert bm.available == len(free) + len(cached)
    # free blocks are unindexed; cached ones are indexed
    assert all(bm.key_of[b] is None for b in free)
    assert all(bm.key_of[b] is not None for b in cached)
    # the index and key_of are inverse maps
    for key, block in bm.index.items():
        assert bm.key_of[block] == key
    assert sum(k is not None for k in bm.key_of) == len(bm.index)
    # a table's key i names its first i + 1 blocks' tokens; where its block is indexed, by it
    for table in tables:
        for block, key in zip(table.blocks, table.keys):
            if bm.key_of[block] is not None:
                assert bm.key_of[block] == key


# --- allocation, reference counts --------------------------------------------------------
def test_start_grow_free_counts():
    bm = BlockManager(10, BS)
    assert (bm.used, bm.available) == (0, 10)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(4) == 1
    assert bm.blocks_for(5) == 2
    a = bm.start([], 9)  # 3 blocks
    assert len(a.blocks) == 3 and len(set(a.blocks)) == 3 and a.keys == []
    assert all(bm.refs[b] == 1 for b in a.blocks)
    assert (bm.used, bm.available) == (3, 7)
    assert bm.grow(a, 12) == []  # still 3 blocks
    new = bm.grow(a, 13)
    assert len(new) == 1 and a.blocks[-1] == new[0] and new[0] not in a.blocks[:-1]
    b = bm.start([], 4)
    assert not set(a.blocks) & set(b.blocks)
    assert bm.used == 5
    check_invariants(bm, [a, b])
    bm.free(a)
    assert a.blocks == [] and a.keys == [] and bm.used == 1
    bm.free(b)
    assert bm.used == 0 and bm.available == 10
    assert bm.refs == [0] * 10
    check_invariants(bm, [])


def test_cost_counts_new_and_cached_matched_blocks():
    bm = BlockManager(10, BS)
    prompt = toks(12)
    a = bm.start([], 12)
    bm.register(a, prompt, 12)
    matched = bm.match(prompt)
    assert matched == a.blocks
    # held by a: matching them costs nothing, only the new blocks past them
    assert bm.cost(matched, 20) == 2
    bm.free(a)
    # cached now (held by nobody): taking them takes them from `available`
    assert bm.cost(matched, 20) == 5
    assert bm.cost([], 20) == 5


def test_double_free_raises():
    bm = BlockManager(4, BS)
    a = bm.start([], 8)
    copy = BlockTable(list(a.blocks), [])
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed more often than held"):
        bm.free(copy)


def test_memory_error_past_available():
    bm = BlockManager(4, BS)
    a = bm.start([], 12)
    with pytest.raises(MemoryError):
        bm.grow(a, 4 * BS + 1)  # 5 blocks of 4
    assert len(a.blocks) == 3 and bm.used == 3  # nothing taken by the failed grow
    with pytest.raises(MemoryError):
        bm.start([], 2 * BS)
    bm.grow(a, 4 * BS)  # exactly the pool
    assert bm.available == 0
    bm.free(a)
    assert bm.used == 0


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0), (-1, 4)])
def test_bad_sizes_refused(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


# --- prefix matching ------------------------------------------------------------------------
def test_match_returns_the_longest_chain_of_full_blocks():
    bm = BlockManager(16, BS)
    prompt = toks(14)  # 3 full blocks and 2 tokens
    a = bm.start([], 20)
    bm.register(a, prompt, len(prompt))
    assert len(a.keys) == 3 and a.keys == keys_of(prompt)
    assert bm.match(prompt) == a.blocks[:3]
    assert bm.match(prompt[:13]) == a.blocks[:3]
    assert bm.match(prompt[:12]) == a.blocks[:3]
    assert bm.match(prompt[:11]) == a.blocks[:2]  # never a partial block
    assert bm.match(prompt[:3]) == []
    assert bm.match(prompt[:8] + [7, 7, 7, 7]) == a.blocks[:2]
    assert bm.match(prompt + toks(10, 500)) == a.blocks[:3]  # longer queries stop there
    assert bm.match([]) == []


def test_a_different_earlier_token_breaks_the_chain():
    """A block's key covers every token before it: the same block contents after a
    different earlier block match nothing."""
    bm = BlockManager(16, BS)
    prompt = toks(12)
    a = bm.start([], 12)
    bm.register(a, prompt, 12)
    other = [999] + prompt[1:]
    assert bm.match(other) == []
    changed_second = prompt[:4] + [999] + prompt[5:]
    assert bm.match(changed_second) == a.blocks[:1]
    # the third block's own tokens alone, at the start, are not its key
    assert bm.match(prompt[8:12]) == []


def test_only_blocks_below_cached_are_registered():
    bm = BlockManager(16, BS)
    tokens = toks(15)
    a = bm.start([], 16)
    bm.register(a, tokens, 7)  # one full block below position 7
    assert len(a.keys) == 1 and len(bm.index) == 1
    assert bm.match(tokens) == a.blocks[:1]
    bm.register(a, tokens, 8)  # now two
    assert len(a.keys) == 2 and bm.match(tokens) == a.blocks[:2]
    bm.register(a, tokens[:9], 15)  # cached past the tokens known: tokens bound it
    assert len(a.keys) == 2
    bm.register(a, tokens, 0)  # a lagging report takes nothing back
    assert len(a.keys) == 2
    bm.register(a, tokens, 15)
    assert len(a.keys) == 3 and bm.match(tokens) == a.blocks[:3]
    check_invariants(bm, [a])


def test_register_never_indexes_past_the_table():
    bm = BlockManager(16, BS)
    tokens = toks(20)
    a = bm.start([], 8)  # 2 blocks only
    bm.register(a, tokens, 20)
    assert len(a.keys) == 2 and len(bm.index) == 2


def test_twins_keep_one_index_entry():
    """The same content written in two tables (both prefilled before either registered):
    one index entry, the second table's block stays unindexed and becomes free when freed."""
    bm = BlockManager(16, BS)
    prompt = toks(8)
    a, b = bm.start([], 8), bm.start([], 8)
    bm.register(a, prompt, 8)
    bm.register(b, prompt, 8)
    assert len(bm.index) == 2
    assert set(bm.index.values()) == set(a.blocks)
    assert all(bm.key_of[blk] is None for blk in b.blocks)
    assert b.keys == a.keys  # b still knows its chain (to go on from)
    check_invariants(bm, [a, b])
    bm.free(b)
    assert sorted(bm._free) == sorted(set(range(16)) - set(a.blocks))  # b's became free
    assert bm.match(prompt) == a.blocks
    # b's chain goes on: a third block of b's registers under the chain of the first two
    c = bm.start(bm.match(prompt + toks(4, 300)), 12)
    bm.register(c, prompt + toks(4, 300), 12)
    assert len(bm.index) == 3
    assert bm.match(prompt + toks(4, 300)) == c.blocks
    check_invariants(bm, [a, c])


def test_matched_blocks_are_shared_and_ref_counted():
    bm = BlockManager(16, BS)
    prompt = toks(10)
    a = bm.start([], 12)
    bm.register(a, prompt, 9)
    matched = bm.match(prompt)
    assert matched == a.blocks[:2]
    a_blocks = list(a.blocks)
    b = bm.start(matched, 14)
    assert b.blocks[:2] == matched and len(b.blocks) == 4
    assert b.keys == a.keys[:2]
    assert [bm.refs[x] for x in matched] == [2, 2]
    assert not set(b.blocks[2:]) & set(a.blocks)
    check_invariants(bm, [a, b])
    bm.free(a)
    assert [bm.refs[x] for x in matched] == [1, 1]
    assert a_blocks[2] in bm._free  # a's unindexed block is free again
    bm.free(b)
    assert bm.used == 0
    assert set(bm._cached) == set(matched)
    check_invariants(bm, [])


def test_freed_indexed_blocks_stay_matchable_until_evicted():
    bm = BlockManager(6, BS)
    prompt = toks(12)
    a = bm.start([], 12)
    bm.register(a, prompt, 12)
    a_blocks = list(a.blocks)
    bm.free(a)
    assert bm.used == 0 and bm.available == 6
    assert bm.match(prompt) == a_blocks
    # new requests take the free blocks first: the cache survives
    b = bm.start([], 12)
    assert not set(b.blocks) & set(bm.index.values())
    assert len(bm.match(prompt)) == 3
    # one more block must come from the cache: the chain's tail goes first
    tail = bm.match(prompt)[2]
    c = bm.start([], 4)
    assert c.blocks == [tail]
    assert len(bm.match(prompt)) == 2 and bm.key_of[tail] is None
    check_invariants(bm, [b, c])
    bm.free(b)
    bm.free(c)
    assert bm.used == 0


def test_a_hit_revives_cached_blocks():
    bm = BlockManager(6, BS)
    prompt = toks(8)
    a = bm.start([], 8)
    bm.register(a, prompt, 8)
    bm.free(a)
    matched = bm.match(prompt)
    b = bm.start(matched, 8)
    assert b.blocks == matched and not bm._cached and bm.used == 2
    # held again: never evicted while held
    c = bm.start([], 16)
    assert not set(c.blocks) & set(matched)
    with pytest.raises(MemoryError):
        bm.start([], 1)
    check_invariants(bm, [b, c])
    bm.free(b)
    bm.free(c)
    assert bm.used == 0 and bm.match(prompt) == matched


def test_eviction_is_least_recent_first_and_tail_first():
    """Tables are freed tail first, so a chain's tail is evicted before its head, and a
    table freed earlier is evicted before one freed later."""
    bm = BlockManager(6, BS)
    first, second = toks(12, 100), toks(12, 200)
    a = bm.start([], 12)
    bm.register(a, first, 12)
    a_blocks = list(a.blocks)
    b = bm.start([], 12)
    bm.register(b, second, 12)
    b_blocks = list(b.blocks)
    bm.free(a)
    bm.free(b)
    taken = []
    lengths = []
    for _ in range(6):
        taken.extend(bm.start([], 4).blocks)
        lengths.append((len(bm.match(first)), len(bm.match(second))))
    assert taken == a_blocks[::-1] + b_blocks[::-1]
    # the older chain shrinks from its tail first; the newer stays whole until then
    assert lengths == [(2, 3), (1, 3), (0, 3), (0, 2), (0, 1), (0, 0)]
    assert not bm.index


def test_a_hit_refreshes_recency():
    bm = BlockManager(4, BS)
    first, second = toks(8, 100), toks(8, 200)
    a = bm.start([], 8)
    bm.register(a, first, 8)
    b = bm.start([], 8)
    bm.register(b, second, 8)
    bm.free(a)
    bm.free(b)
    c = bm.start(bm.match(first), 8)  # first is used again: now the most recent
    bm.free(c)
    bm.start([], 8)  # evicts two blocks: second's
    assert len(bm.match(first)) == 2 and bm.match(second) == []


def test_used_returns_to_zero_after_freeing_everything():
    bm = BlockManager(32, BS)
    tables = []
    for i in range(5):
        prompt = toks(4) + toks(6, 100 * (i + 1))
        t = bm.start(bm.match(prompt), 12)
        bm.register(t, prompt, len(prompt) - 1)
        tables.append(t)
    assert bm.refs[tables[0].blocks[0]] == 5  # the shared first block
    check_invariants(bm, tables)
    for t in tables:
        bm.free(t)
    assert bm.used == 0 and sum(bm.refs) == 0 and bm.available == 32
    check_invariants(bm, [])


def test_prefix_caching_off_matches_nothing():
    bm = BlockManager(16, BS, prefix_caching=False)
    prompt = toks(12)
    a = bm.start([], 12)
    bm.register(a, prompt, 12)
    assert bm.match(prompt) == [] and not bm.index and a.keys == []
    bm.free(a)
    assert len(bm._free) == 16 and not bm._cached
    assert bm.match(prompt) == []
    check_invariants(bm, [])


# --- churn ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_randomized_churn_keeps_the_books(seed):
    """Requests start from prefix matches, grow, register (with lagging `cached` reports)
    and free in a seeded random order; after every step the books hold their invariants,
    every index entry's block holds the tokens its key names, every match is right, no
    write lands in a shared or indexed block, and the pool ends empty."""
    rng = random.Random(seed)
    bm = BlockManager(rng.choice([12, 24, 40]), BS, prefix_caching=True)
    contents: dict[int, list[int | None]] = {}  # what each block's KV holds, as written
    named: dict[bytes, list[int]] = {}  # chain key -> its block's tokens
    # a few shared prefixes make hits likely
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 14))] for _ in range(4)]
    live: list[list] = []  # [table, committed tokens, cached so far]
    hits = 0

    def write(table: BlockTable, tokens: list[int], start: int, end: int) -> None:
        for p in range(start, end):
            block = table.blocks[p // BS]
            assert bm.refs[block] == 1 and bm.key_of[block] is None, (
                "a write into a shared or indexed block"
            )
            contents.setdefault(block, [None] * BS)[p % BS] = tokens[p]

    def register(table: BlockTable, tokens: list[int], cached: int) -> None:
        for i, key in enumerate(keys_of(tokens[:cached])):
            named[key] = tokens[i * BS : (i + 1) * BS]
        bm.register(table, tokens, cached)

    for _ in range(500):
        action = rng.random()
        if action < 0.35 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            matched = bm.match(tokens[:-1])
            hits += bool(matched)
            for i, block in enumerate(matched):  # a hit's blocks hold the query's tokens
                assert contents[block] == tokens[i * BS : (i + 1) * BS]
            positions = len(tokens) + rng.randrange(0, 8)
            if bm.cost(matched, positions) > bm.available:
                if live:
                    bm.free(live.pop(rng.randrange(len(live)))[0])
                continue
            before, cost = bm.available, bm.cost(matched, positions)
            table = bm.start(matched, positions)
            assert before - bm.available == cost  # cost() is what start() takes
            write(table, tokens, len(matched) * BS, len(tokens) - 1)
            register(table, tokens, len(tokens) - 1)
            live.append([table, tokens, len(tokens) - 1])
        elif action < 0.7:
            entry = live[rng.randrange(len(live))]
            table, tokens, _ = entry
            new = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            want = len(tokens) + len(new) + rng.randrange(0, 6)
            if bm.blocks_for(want) - len(table.blocks) > bm.available:
                used = bm.used
                with pytest.raises(MemoryError):
                    bm.grow(table, want)
                assert bm.used == used
                continue
            bm.grow(table, want)
            grown = tokens + new
            write(table, grown, len(tokens) - 1, len(grown) - 1)
            # a lagging report: only part of what was written is known cached on every rank
            cached = rng.randrange(len(tokens) - 1, len(grown))
            register(table, grown, cached)
            entry[1:] = [grown, max(entry[2], cached)]
        else:
            bm.free(live.pop(rng.randrange(len(live)))[0])
        tables = [t for t, _, _ in live]
        check_invariants(bm, tables)
        for key, block in bm.index.items():
            assert contents[block] == named[key]
        for table, tokens, cached in live:
            assert table.keys == keys_of(tokens)[: len(table.keys)]
            assert len(table.keys) <= cached // BS  # never past what was cached
    assert hits > 0
    for table, _, _ in live:
        bm.free(table)
    check_invariants(bm, [])
    assert bm.used == 0 and bm.available == bm.num_blocks
