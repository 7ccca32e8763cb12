"""A model shard on a worker: its model, its step runner and its slots' speculation state
(runtime.worker.slot_state: the shard's SlotBook is the only writer of lengths and pending
tokens, and work done ahead of its round is an Extension record)."""

from __future__ import annotations

from typing import cast

import torch

from runtime.control.commands import Sampling
from runtime.models.arch.base import is_paged
from runtime.models.runners.hostcopy import to_device
from runtime.models.runners.step_runner import StepRunner
from runtime.speculation.choose import BatchSampling, draft_choose
from runtime.speculation.vocab import DraftVocab
from runtime.worker.block_tables import SlotTables
from runtime.worker.slot_state import GREEDY, Extension, SlotBook, SlotState

__all__ = ["GREEDY", "SlotState", "ModelShard", "DraftShard"]


class ModelShard:
    refeeds_last = False  # the draft keeps a token pending (slot_state.SlotBook)

    def __init__(
        self,
        model,
        device: torch.device,
        num_slots: int,
        max_seq_len: int,
        acceptance: str = "tokens",
        max_step_len: int = 2,
        cuda_graphs: bool = True,
        prefill_graphs: bool | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_dtype: str = "auto",
    ):
        """max_step_len: the most tokens a decode/verify step appends per slot (draft_len + 1
        for the target); such steps run at static shapes (CUDA graphs on CUDA). Prompts run
        in static chunks too unless prefill_graphs is False. block_size: positions per KV
        block (runtime.kv_block_size); num_blocks: the pool's blocks (default: every slot's
        fixed table); kv_dtype: runtime.kv_cache_dtype. The model reads and writes through
        the block tables rank 0 sends (block_tables.SlotTables)."""
        self.model = model
        self.acceptance = acceptance
        self.device = device
        self.max_seq_len = max_seq_len
        self.slots = SlotBook(num_slots, max_seq_len, self.refeeds_last)
        # per slot, what an overlapped round carries to the next (runtime.worker.overlap):
        # the draft's next window, the target's held logits; gone with the slot's sequence
        self.carried: dict[int, object] = {}
        self.tables: SlotTables | None = None  # None: a model with its own cache
        if is_paged(model):
            model.allocate_cache(num_slots, max_seq_len, block_size, num_blocks, kv_dtype)
            self.tables = SlotTables(
                num_slots, model.blocks_per_seq, model.num_blocks, block_size, device
            )
        else:
            model.allocate_cache(num_slots, max_seq_len)
        self.runner = StepRunner(
            model, device, num_slots, max_step_len, cuda_graphs, prefill_graphs
        )

    def forward_rows(self, slots: list[int], rows: list[list[int]]) -> torch.Tensor:
        """Append ragged `rows` to each slot's cache; returns logits [B, T, V]."""
        return self._step(slots, *self._ragged(rows))

    def feed_rows(self, slots: list[int], rows: list[list[int]]) -> None:
        """Append ragged `rows` to each slot's cache (prompts: their KV is all that is kept;
        StepRunner.prefill)."""
        self.runner.prefill(*self._append(slots, *self._ragged(rows)))

    def _ragged(self, rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """rows padded into ids [B, T] on the device, and each row's length."""
        width = max(len(r) for r in rows)
        ids = to_device([r + [0] * (width - len(r)) for r in rows], torch.long, self.device)
        return ids, [len(r) for r in rows]

    def _step(
        self, slots: list[int], ids: torch.Tensor, n_valid: list[int] | None = None
    ) -> torch.Tensor:
        """ids [B, T] on the device, appended at each slot's cache_len; logits [B, T, V]."""
        return self.runner.run(*self._append(slots, ids, n_valid))

    def _step_last(self, slots: list[int], ids: torch.Tensor, n_valid: list[int]) -> torch.Tensor:
        """_step for a prompt's end: each row's logits at its last valid token [B, V]
        (StepRunner.prefill_last)."""
        return self.runner.prefill_last(*self._append(slots, ids, n_valid))

    def _append(
        self, slots: list[int], ids: torch.Tensor, n_valid: list[int] | None
    ) -> tuple[torch.Tensor, list[int] | torch.Tensor, list[int], list[int]]:
        """A step's arguments to the runner: the ids (as the model takes them), the rows'
        tables (slots for a model with its own cache), each row's start (its slot's
        cache_len, now advanced by n_valid: default, every id) and n_valid."""
        if n_valid is None:
            n_valid = [ids.shape[1]] * len(slots)
        starts = self.slots.append(
            slots, n_valid, None if self.tables is None else self.tables.capacity
        )
        rows = slots if self.tables is None else self.tables.rows(slots)
        return self._inputs(ids), rows, starts, n_valid

    def _inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """ids as the model takes them."""
        return ids

    def sampling(self, slots: list[int]) -> BatchSampling:
        return BatchSampling.of([self.slots[s].sampling for s in slots], self.device)

    def committed_index(self, slots: list[int]) -> torch.Tensor:
        """[B] sequence index of the next token to decide."""
        return to_device([self.slots[s].committed for s in slots], torch.long, self.device)

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[Sampling] | None = None,
        cached: list[int] | None = None,
        tables: list[list[int]] | None = None,
        through: bool = False,
    ) -> None:
        """Cache every token but the last, which stays pending. prompts: per slot, its
        tokens from position cached[i] on (default 0: whole prompts; the positions before
        are in its table's blocks already: prefix hits, earlier chunks); tables: the slots'
        block tables (default: as they are). through: the last too (a prompt's end, whose
        first output token the target picks: the draft's cache then holds the whole prompt,
        and that token alone is pending once committed)."""
        self._start(slots, prompts, params, cached, tables)
        rows = [
            (s, p if through else p[:-1])
            for s, p in zip(slots, prompts)
            if len(p) > (0 if through else 1)
        ]
        if rows:
            self.feed_rows([s for s, _ in rows], [r for _, r in rows])

    def _start(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[Sampling] | None,
        cached: list[int] | None,
        tables: list[list[int]] | None,
    ) -> list[int]:
        """New sequences in these slots (their tables, prompts, sampling); the cached
        positions per slot."""
        params = params or [GREEDY] * len(slots)
        cached = cached or [0] * len(slots)
        if tables and self.tables is not None:
            self.tables.set(slots, tables)
        elif any(cached) and self.tables is None:
            raise ValueError(
                "cached positions need the paged KV cache (a model with its own "
                "cache prefills whole prompts)"
            )
        for slot, prompt, sampling, done in zip(slots, prompts, params, cached):
            self.slots.start(slot, prompt, sampling, done)
            self.carried.pop(slot, None)
            if self.model_free_slot is not None:
                self.model_free_slot(slot)
        return cached

    @property
    def model_free_slot(self):
        return getattr(self.model, "free_slot", None)

    def append_decoded(self, slots: list[int], rows: list[list[int]]) -> None:
        """Commit tokens the target decoded alone (a target-only round). Whatever of
        pending + rows the cache does not hold stays pending: on the target (whose decode
        steps cached all but the last) that is the last token; on the draft, all of them."""
        for slot, row in zip(slots, rows):
            self.slots.commit(slot, len(row), len(row), row)

    def grow(self, slots: list[int], tables: list[list[int]]) -> None:
        """Blocks appended to these slots' tables (a round command's)."""
        if tables and self.tables is not None:
            self.tables.extend(slots, tables)

    def cached(self, slots: list[int]) -> list[int]:
        """Per slot, the positions whose KV holds committed tokens."""
        return [self.slots[s].cache_len for s in slots]

    def release(self, slots: list[int]) -> None:
        if self.tables is not None:
            self.tables.reset(slots)
        for slot in slots:
            self.slots.reset(slot)
            self.carried.pop(slot, None)
            if self.model_free_slot is not None:
                self.model_free_slot(slot)


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
        token, q = draft_choose(logits, sampling, index, self.acceptance, self.vocab)
        return self._continue(slots, [token], [] if q is None else [q], k, sampling, index)

    def _continue(
        self,
        slots: list[int],
        tokens: list[torch.Tensor],
        probs: list[torch.Tensor],
        k: int,
        sampling: BatchSampling,
        index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode from the proposals so far (tokens [B] each, their q [B, V] when sampling)
        until there are k: tokens [B, k], q [B, k, V] or None. index [B]: sequence index of
        each row's first proposal."""
        for i in range(len(tokens), k):
            logits = self._step(slots, tokens[-1][:, None])[:, -1]  # [B, V]
            token, q = draft_choose(logits, sampling, index + i, self.acceptance, self.vocab)
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
        (the slots then hold this round's proposals only)."""
        k, marks = tokens.shape[1], self.slots.mark(slots)
        try:
            more, more_q = self._continue(
                slots,
                list(tokens.unbind(1)),
                [] if probs is None else list(probs.unbind(1)),
                k + count,
                self.sampling(slots),
                self.committed_index(slots),
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
