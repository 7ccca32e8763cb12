"""A model shard on a worker: its model, its step runner and its slots' speculation state
(runtime.worker.slot_state: the shard's SlotBook is the only writer of lengths and pending
tokens, and work done ahead of its round is an Extension record)."""

from __future__ import annotations

import torch

from runtime.control.commands import Sampling
from runtime.models.arch.base import is_paged
from runtime.models.runners.hostcopy import to_device
from runtime.models.runners.step_runner import StepRunner
from runtime.speculation.choose import BatchSampling
from runtime.speculation.grammar.book import GrammarBook
from runtime.worker.block_tables import SlotTables
from runtime.worker.history import TokenHistory
from runtime.worker.slot_state import GREEDY, SlotBook, SlotState

__all__ = ["GREEDY", "SlotState", "ModelShard"]


class ModelShard:
    refeeds_last = False  # the draft keeps a token pending (slot_state.SlotBook)
    # samples under the requests' grammars (runtime.speculation.grammar.book); a draft may propose
    # freely instead (speculation.mask_draft: false), its proposals checked by the target's
    follows_grammars = True

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
        verification: str = "token",
    ):
        """max_step_len: the most tokens a decode/verify step appends per slot (draft_len + 1
        for the target); such steps run at static shapes (CUDA graphs on CUDA). Prompts run
        in static chunks too unless prefill_graphs is False. block_size: positions per KV
        block (runtime.kv_block_size); num_blocks: the pool's blocks (default: every slot's
        fixed table); kv_dtype: runtime.kv_cache_dtype; verification:
        speculation.verification. The model reads and writes through the block tables rank 0
        sends (block_tables.SlotTables)."""
        self.model = model
        self.acceptance = acceptance
        self.verification = verification
        self.device = device
        self.max_seq_len = max_seq_len
        self.slots = SlotBook(num_slots, max_seq_len, self.refeeds_last)
        # per slot, what an overlapped round carries to the next (runtime.worker.overlap):
        # the draft's next window, the target's held logits; gone with the slot's sequence
        self.carried: dict[int, object] = {}
        self.history = TokenHistory(num_slots, device)  # what penalties look back on
        self.grammars = GrammarBook(device)  # structured outputs' matchers
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

    @property
    def token_range(self) -> int:
        """The token ids its sampling processes (logit_bias, penalties): the target's
        vocabulary; 0: none (a draft with another tokenizer)."""
        return self.model.vocab_size

    def greedy(self, slots: list[int]) -> bool:
        """Whether every row samples greedily (no tensors built: sampling() builds them)."""
        return all(self.slots[s].sampling.temperature == 0 for s in slots)

    def reports_logprobs(self, slots: list[int]) -> bool:
        return any(self.slots[s].sampling.logprobs >= 0 for s in slots)

    def sampling(self, slots: list[int]) -> BatchSampling:
        params = [self.slots[s].sampling for s in slots]
        history = self.history.rows(slots) if any(p.penalised for p in params) else None
        return BatchSampling.of(params, self.device, self.token_range, history)

    @property
    def block_verified(self) -> bool:
        """Whether sampled windows are verified as blocks (`logits` acceptance,
        `verification: block`): the draft's samples are then keyed by window."""
        return self.acceptance == "logits" and self.verification == "block"

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
            self.history.start(slot, sampling, self.token_range)
            if self.token_range and self.follows_grammars:
                self.grammars.start(slot, sampling)
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
            self.history.release(slot)
            self.grammars.release(slot)
            self.carried.pop(slot, None)
            if self.model_free_slot is not None:
                self.model_free_slot(slot)
