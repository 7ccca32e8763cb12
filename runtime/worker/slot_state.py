"""Per-slot speculation state, and the one place that changes it.

Per slot a shard knows `committed` (tokens of the sequence so far: prompt + accepted),
`cache_len` (positions held in the KV cache) and `pending` (committed tokens not yet in the
cache). Between commands every slot keeps the invariant

    cache_len + len(pending) == committed

Within a round the cache runs ahead of it: a step feeds the pending tokens and then proposals
(draft tokens, or the target's own decode steps); the round's verdict (`SlotBook.commit`)
keeps the KV of the proposals that were committed and drops the rest. Rollback is a length
update: stale KV positions are simply overwritten.

Work done before its round was asked for (the draft's proposals made ahead, the target's
decode steps made ahead, an overlapped draft's next window) is one record, an `Extension`:
its tokens, and where its slots stood when it was made (their marks). Making it leaves the
slots' states as they were (`SlotBook.rollback` to the marks: the one rollback, also of work
a full cache cut short); the round that takes it extends the slots' caches over what it takes
(`SlotBook.take`); a round it does not fit forgets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, TypeGuard

import torch

from runtime.control.commands import GREEDY, Sampling


@dataclass
class SlotState:
    committed: int = 0
    cache_len: int = 0
    pending: list[int] = field(default_factory=list)
    sampling: Sampling = GREEDY


class Mark(NamedTuple):
    """A slot's state at one moment (SlotBook.mark)."""

    committed: int
    cache_len: int
    pending: tuple[int, ...]


@dataclass
class Extension:
    """Proposals worked out past the committed tokens of `slots` before their round asked for
    them. Fed to the caches, all but the last: each slot's cache held its pending tokens and
    the first n - 1 proposals (positions past its cache_len now, untouched until taken)."""

    slots: list[int]
    tokens: torch.Tensor  # [B, n] on the device
    probs: torch.Tensor | None  # [B, n, V] q when sampling, else None
    marks: list[Mark]  # where each slot stood when it was made

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


class SlotBook:
    """Every slot's state on one shard, changed only through these operations. A draft
    (`refeeds_last`) keeps at least one token pending: it holds no logits to draft the next
    token from; a target may cache every committed token when it holds their logits."""

    def __init__(self, num_slots: int, max_seq_len: int, refeeds_last: bool):
        self.states = [SlotState() for _ in range(num_slots)]
        self.max_seq_len = max_seq_len
        self.refeeds_last = refeeds_last

    def __getitem__(self, slot: int) -> SlotState:
        return self.states[slot]

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def check(self, slot: int) -> SlotState:
        if not 0 <= slot < len(self.states):
            raise ValueError(f"slot {slot} out of range 0..{len(self.states) - 1}")
        return self.states[slot]

    # --- a sequence's life ---------------------------------------------------------------
    def start(self, slot: int, tokens: list[int], sampling: Sampling, cached: int = 0) -> None:
        """A sequence (re)starts: its first `cached` positions are in the cache already (a
        prefix hit, earlier chunks of its prompt), `tokens` follow them; all committed, the
        last pending. The prefill that follows caches the others (append)."""
        self.check(slot)
        if cached < 0 or not tokens:
            raise ValueError(f"slot {slot}: {cached} cached positions and {len(tokens)} tokens")
        self.states[slot] = SlotState(cached + len(tokens), cached, [tokens[-1]], sampling)

    def rewind(self, slot: int, keep: int, tokens: list[int]) -> None:
        """The sequence is now its first `keep` cached positions and `tokens` (a draft with
        another tokenizer, re-synced from the committed text): the last is pending, the
        others are to be fed (append) as a prefill's are. keep 0 needs start."""
        state = self.check(slot)
        if not 0 < keep <= state.cache_len or not tokens:
            raise ValueError(
                f"slot {slot}: keeps {keep} of {state.cache_len} cached "
                f"positions with {len(tokens)} tokens"
            )
        state.cache_len, state.committed, state.pending = keep, keep + len(tokens), [tokens[-1]]

    def reset(self, slot: int) -> None:
        self.check(slot)
        self.states[slot] = SlotState()

    # --- the cache grows, the round commits ------------------------------------------------
    def append(self, slots: list[int], counts: list[int], capacity=None) -> list[int]:
        """Positions for `counts` tokens fed to each slot's cache: their start positions.
        capacity(slot): the positions its KV blocks address (None: max_seq_len only)."""
        starts = [self.states[s].cache_len for s in slots]
        for slot, start, n in zip(slots, starts, counts):
            if start + n > self.max_seq_len:
                raise ValueError(f"slot {slot}: sequence exceeds max_seq_len {self.max_seq_len}")
            if capacity is not None and start + n > capacity(slot):
                raise ValueError(
                    f"slot {slot}: positions {start}..{start + n - 1} lie past "
                    f"its KV blocks ({capacity(slot)} positions)"
                )
        for slot, n in zip(slots, counts):
            self.states[slot].cache_len += n
        return starts

    def commit(self, slot: int, added: int, cached: int, tail: list[int]) -> None:
        """The round's verdict: `added` tokens join the committed sequence. The first
        `cached` of them are the proposals this round fed right after the pending tokens
        (their KV stays, as far as it was fed); `tail` ends the new sequence and holds at
        least every token not cached (a draft's also its last). Proposals fed past the
        committed ones are dropped: a length update."""
        state = self.states[slot]
        base = state.committed - len(state.pending)  # cached before the round
        valid = base + min(state.cache_len - base, len(state.pending) + cached)
        state.committed += added
        uncached = state.committed - valid
        if uncached == 0 and self.refeeds_last:
            uncached, valid = 1, valid - 1
        known = state.pending + tail
        if uncached > len(known):
            raise ValueError(
                f"slot {slot}: commit leaves {uncached} tokens uncached, knows {len(known)}"
            )
        state.pending = known[len(known) - uncached :]
        state.cache_len = valid

    # --- work ahead --------------------------------------------------------------------------
    def mark(self, slots: list[int]) -> list[Mark]:
        """Where these slots stand: what work ahead starts from and rollback returns to."""
        return [
            Mark(self.states[s].committed, self.states[s].cache_len, tuple(self.states[s].pending))
            for s in slots
        ]

    def rollback(self, slots: list[int], marks: list[Mark]) -> None:
        """Back to the marks (taken by mark, the states committing nothing since): whatever
        was fed after them is dropped, a length update."""
        for slot, mark in zip(slots, marks):
            self.states[slot].cache_len = mark.cache_len

    def fits(self, ext: Extension | None, slots: list[int]) -> TypeGuard[Extension]:
        """Whether `ext` extends exactly these slots, which stand where it started."""
        return ext is not None and ext.slots == slots and ext.marks == self.mark(slots)

    def take(self, ext: Extension, keep: int) -> None:
        """Take the first `keep` proposals of `ext` (which fits): its slots' caches hold
        their pending tokens and keep - 1 of the proposals (the next step feeds the last)."""
        keep = min(keep, ext.length)
        for slot, mark in zip(ext.slots, ext.marks):
            self.states[slot].cache_len = mark.cache_len + len(mark.pending) + keep - 1
