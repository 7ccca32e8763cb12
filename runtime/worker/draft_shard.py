"""The draft's model shard on a worker (runtime.worker.shards.ModelShard): its proposals, on
command and ahead of their round, and the next windows of overlapped rounds."""

from __future__ import annotations

from typing import cast

import torch

from runtime.control.commands import Sampling
from runtime.models.runners.hostcopy import HostCopy, to_device
from runtime.speculation.choose import BatchSampling, draft_choose
from runtime.speculation.vocab import DraftVocab
from runtime.worker.shards import ModelShard
from runtime.worker.slot_state import Extension


class DraftShard(ModelShard):
    """Besides proposing on command, the draft works ahead (slot_state.Extension): the next
    round's proposals right after a commit (`propose_ahead`: the GPU drafts while the verdict
    travels to the orchestrator and the next command travels back), and with overlap each
    kept slot's next window, drafted during the verify (`draft_window`). A round that fits
    (same slots in the same states, k no larger) takes those proposals; others forget them.

    `vocab` (runtime.speculation.vocab.DraftVocab) is set when the draft's embedding is
    padded differently from the target's: proposals are then ids < vocab.propose, q is as
    wide as the target's vocabulary, and ids fed in are clamped into the draft's embedding."""

    refeeds_last = True
    ahead: Extension | None = None
    vocab: DraftVocab | None = None
    cross = False  # another tokenizer: own fixed block tables, synced from text

    def resync(
        self, slots: list[int], keep: list[int], tokens: list[list[int]], params: list[Sampling]
    ) -> None:
        """A draft with another tokenizer (cross): each slot's sequence becomes its first
        keep[i] cached positions and tokens[i] (keep 0: a new sequence, sampled with
        params[i]); all but the last token are fed, the last stays pending."""
        for slot, n, row, sampling in zip(slots, keep, tokens, params):
            if n == 0:
                self._start([slot], [row], [sampling], None, None)
            else:
                self.slots.rewind(slot, n, row)
        rows = [(s, r[:-1]) for s, r in zip(slots, tokens) if len(r) > 1]
        if rows:
            self.feed_rows([s for s, _ in rows], [r for _, r in rows])

    @property
    def token_range(self) -> int:
        return 0 if self.cross else self.q_width

    @property
    def q_width(self) -> int:
        """The width of the q it sends: the target's vocab_size."""
        return self.model.vocab_size if self.vocab is None else self.vocab.width

    def _inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """ids clamped into the draft's embedding (a draft padded differently)."""
        return ids if self.vocab is None else self.vocab.inputs(ids)

    @property
    def windows(self) -> dict[int, Extension]:
        """slot -> its next window (one row), drafted while the target verified the last."""
        return cast("dict[int, Extension]", self.carried)

    def propose_ahead(self, slots: list[int], k: int) -> None:
        if self.grammars.active:  # a grammar's proposals follow the committed tokens
            return
        marks = self.slots.mark(slots)
        try:
            tokens, probs = self.propose(slots, k)
        except ValueError:  # a slot's cache is full: this round will not happen
            return
        finally:
            self.slots.rollback(slots, marks)  # the work is the record's; states stay
        self.ahead = Extension(slots, tokens, probs, marks)

    def take_ahead(
        self, slots: list[int], k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The proposals made ahead for exactly these slots: their first k, or all of them
        continued to k; None for other slots."""
        ahead, self.ahead = self.ahead, None
        if not self.slots.fits(ahead, slots):
            return None
        self.slots.take(ahead, k)
        tokens, probs = ahead.tokens, ahead.probs
        if k <= tokens.shape[1]:
            return tokens[:, :k], None if probs is None else probs[:, :k]
        return self._continue(
            slots,
            list(tokens.unbind(1)),
            [] if probs is None else list(probs.unbind(1)),
            k,
            self.sampling(slots),
            self.committed_index(slots),
        )

    def drop_ahead(self) -> None:
        self.ahead = None

    def propose(self, slots: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode k tokens per slot: tokens [B, k] on the device and, when sampling, the
        distributions q [B, k, V] they were drawn from."""
        pending = [self.slots[s].pending for s in slots]
        logits = self.forward_rows(slots, pending)  # [B, T, V]
        if all(len(p) == 1 for p in pending):
            logits = logits[:, 0]  # [B, V]
        else:
            last = to_device([len(p) - 1 for p in pending], torch.long, self.device)
            logits = logits[torch.arange(len(slots), device=self.device), last]  # [B, V]
        sampling, index = self.sampling(slots), self.committed_index(slots)  # index [B]
        mask = self.grammars.step_masks(slots)
        start = index if self.block_verified else None  # the window's first index
        token, q = draft_choose(
            logits, sampling, index, self.acceptance, self.vocab, None, mask, start
        )
        chosen = self.grammars.to_host(slots, token)
        try:
            return self._continue(
                slots, [token], [] if q is None else [q], k, sampling, index, chosen
            )
        finally:
            self.grammars.rewind(slots)  # proposals, not commitments

    def _continue(
        self,
        slots: list[int],
        tokens: list[torch.Tensor],
        probs: list[torch.Tensor],
        k: int,
        sampling: BatchSampling,
        index: torch.Tensor,
        chosen: HostCopy | None = None,
        next_at: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode from the proposals so far (tokens [B] each, their q [B, V] when sampling)
        until there are k: tokens [B, k], q [B, k, V] or None. index [B]: sequence index of
        each row's first proposal. chosen: the last proposal on its way to the grammars'
        matchers (GrammarBook.to_host), which advance over it while the next step runs.
        next_at: the proposals from this one on are the next window's (overlap), which starts
        at index + next_at (what keys the draft's samples under block verification)."""
        for i in range(len(tokens), k):
            start = None
            if self.block_verified:
                start = index + (next_at if next_at is not None and i >= next_at else 0)
            logits = self._step(slots, tokens[-1][:, None])[:, -1]  # [B, V]
            self.grammars.advance(slots, chosen)  # on the host, while the step runs
            window = torch.stack(tokens, dim=1) if sampling.processing.active else None
            mask = self.grammars.step_masks(slots)  # after the proposals so far
            token, q = draft_choose(
                logits, sampling, index + i, self.acceptance, self.vocab, window, mask, start
            )
            chosen = self.grammars.to_host(slots, token)
            tokens.append(token)
            if q is not None:
                probs.append(q)
        q_all = torch.stack(probs, dim=1) if probs else None  # [B, k, V]
        return torch.stack(tokens, dim=1), q_all  # [B, k]

    def commit(
        self,
        slots: list[int],
        draft_tokens: list[list[int]],
        accepted: list[int],
        next_tokens: list[int],
    ) -> None:
        """The verdict of a round that proposed draft_tokens. The cache keeps the accepted
        drafts among the first k - 1 (the k-th is fed with the next proposal)."""
        k = len(draft_tokens[0])
        for slot, drafts, a, nxt in zip(slots, draft_tokens, accepted, next_tokens):
            self.slots.commit(slot, a + 1, min(a, k - 1), drafts[:a][-1:] + [nxt])

    # --- overlap (runtime.worker.overlap): next windows ----------------------------------
    def draft_window(
        self, slots: list[int], tokens: torch.Tensor, probs: torch.Tensor | None, count: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """While the target verifies tokens [B, k]: decode on as if all are kept, `count`
        more per slot (tokens [B, count], q or None). None when a slot's cache has no room
        (the slots then hold this round's proposals only) or a slot has a grammar."""
        if self.grammars.active:  # its masks follow the committed tokens
            return None
        k, marks = tokens.shape[1], self.slots.mark(slots)
        try:
            more, more_q = self._continue(
                slots,
                list(tokens.unbind(1)),
                [] if probs is None else list(probs.unbind(1)),
                k + count,
                self.sampling(slots),
                self.committed_index(slots),
                next_at=k,
            )
        except ValueError:  # past the cache: this slot is about to finish anyway
            self.slots.rollback(slots, marks)
            return None
        return more[:, k:], None if more_q is None else more_q[:, k:]

    def commit_kept(
        self,
        slot: int,
        added: int,
        last: int,
        window: torch.Tensor | None,
        window_probs: torch.Tensor | None,
    ) -> None:
        """A slot whose window was kept: `added` proposals committed as drafted, `last` the
        final one; the proposals drafted past them ([m], q [m, V]) are its next window."""
        self.slots.commit(slot, added, added, [last])
        if window is not None:
            self.windows[slot] = Extension(
                [slot],
                window[None],
                None if window_probs is None else window_probs[None],
                self.slots.mark([slot]),
            )

    def has_window(self, slot: int, k: int) -> bool:
        """Whether the slot's next window holds at least k proposals."""
        window = self.windows.get(slot)
        return self.slots.fits(window, [slot]) and window.length >= k

    def take_window(self, slot: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first k proposals of the slot's next window (has_window): tokens [k] and q
        [k, V] (None when it was drafted greedily)."""
        window = self.windows.pop(slot)
        self.slots.take(window, k)
        return window.tokens[0, :k], None if window.probs is None else window.probs[0, :k]

    def drop_windows(self, slots: list[int] | None = None) -> None:
        """Forget next windows (all, or these slots'): the slots draft afresh."""
        for slot in list(self.windows) if slots is None else slots:
            self.windows.pop(slot, None)
