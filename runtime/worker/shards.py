"""A model shard on a worker and its per-slot speculation state.

Per slot the shard knows `committed` (tokens of the sequence so far: prompt + accepted),
`cache_len` (positions held in the KV cache) and `pending` (committed tokens not yet in the
cache). Invariant: cache_len + len(pending) == committed. Rollback is a length update.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from runtime.speculation.acceptance import accept_choices
from runtime.speculation.choose import BatchSampling, draft_choose, target_verify
from runtime.models.runners.hostcopy import to_device
from runtime.models.runners.step_runner import StepRunner

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


@dataclass
class SlotState:
    committed: int = 0
    cache_len: int = 0
    pending: list[int] = field(default_factory=list)
    sampling: dict = field(default_factory=lambda: dict(GREEDY))


@dataclass
class DraftAhead:
    """Proposals drafted before their round's command arrived (DraftShard.propose_ahead)."""
    slots: list[int]
    tokens: torch.Tensor                # [B, k] on the device
    probs: torch.Tensor | None          # [B, k, V] q when sampling, else None
    saved: list[SlotState]              # the slots' states before drafting: the rollback


@dataclass
class TargetAhead:
    """Target-only decode steps queued before their round's command (decode_ahead)."""
    slots: list[int]
    tokens: torch.Tensor                # [B, n] on the device
    states: list[SlotState]             # the slots' states the tokens follow


class ModelShard:
    def __init__(self, model, device: torch.device, num_slots: int, max_seq_len: int,
                 acceptance: str = "tokens", max_step_len: int = 2, cuda_graphs: bool = True,
                 prefill_graphs: bool | None = None):
        """max_step_len: the most tokens a decode/verify step appends per slot (draft_len + 1
        for the target); such steps run at static shapes (CUDA graphs on CUDA). Prompts run
        in static chunks too unless prefill_graphs is False (None: TANDEM_PREFILL_GRAPHS)."""
        self.model = model
        self.acceptance = acceptance
        self.device = device
        self.max_seq_len = max_seq_len
        self.slots = [SlotState() for _ in range(num_slots)]
        # per slot, what an overlapped round carries to the next (runtime.worker.overlap):
        # the draft's next window, the target's held logits; gone with the slot's sequence
        self.carried: dict[int, object] = {}
        model.allocate_cache(num_slots, max_seq_len)
        self.runner = StepRunner(model, device, num_slots, max_step_len, cuda_graphs,
                                 prefill_graphs)

    def _check_slot(self, slot: int) -> SlotState:
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"slot {slot} out of range 0..{len(self.slots) - 1}")
        return self.slots[slot]

    def _save(self, slots: list[int]) -> list[SlotState]:
        return [replace(self.slots[s], pending=list(self.slots[s].pending)) for s in slots]

    def _restore(self, slots: list[int], saved: list[SlotState]) -> None:
        for slot, state in zip(slots, saved):
            self.slots[slot] = state

    def forward_rows(self, slots: list[int], rows: list[list[int]], logits: bool = True
                     ) -> torch.Tensor | None:
        """Append ragged `rows` to each slot's cache; returns logits [B, T, V] (None with
        logits=False: prompts, whose KV is all that is kept)."""
        width = max(len(r) for r in rows)
        ids = to_device([r + [0] * (width - len(r)) for r in rows], torch.long, self.device)
        return self._step(slots, ids, [len(r) for r in rows], logits)

    def _step(self, slots: list[int], ids: torch.Tensor, n_valid: list[int] | None = None,
              logits: bool = True) -> torch.Tensor | None:
        """ids [B, T] on the device, appended at each slot's cache_len; logits [B, T, V]
        (or None when not wanted: StepRunner.prefill)."""
        if n_valid is None:
            n_valid = [ids.shape[1]] * len(slots)
        starts = [self.slots[s].cache_len for s in slots]
        for slot, start, n in zip(slots, starts, n_valid):
            if start + n > self.max_seq_len:
                raise ValueError(f"slot {slot}: sequence exceeds max_seq_len {self.max_seq_len}")
            self.slots[slot].cache_len += n
        if not logits:
            return self.runner.prefill(ids, slots, starts, n_valid)
        return self.runner.run(ids, slots, starts, n_valid)

    def sampling(self, slots: list[int]) -> BatchSampling:
        return BatchSampling.of([self.slots[s].sampling for s in slots], self.device)

    def committed_index(self, slots: list[int]) -> torch.Tensor:
        """[B] sequence index of the next token to decide."""
        return to_device([self.slots[s].committed for s in slots], torch.long, self.device)

    def prefill(self, slots: list[int], prompts: list[list[int]],
                params: list[dict] | None = None) -> None:
        """Cache every prompt token but the last, which stays pending."""
        params = params or [GREEDY] * len(slots)
        for slot, prompt, sampling in zip(slots, prompts, params):
            state = self._check_slot(slot)
            self.carried.pop(slot, None)
            if self.model_free_slot is not None:
                self.model_free_slot(slot)
            state.committed, state.cache_len, state.pending = len(prompt), 0, [prompt[-1]]
            state.sampling = {key: sampling[key] for key in GREEDY}
        rows = [(s, p[:-1]) for s, p in zip(slots, prompts) if len(p) > 1]
        if rows:
            self.forward_rows([s for s, _ in rows], [r for _, r in rows], logits=False)

    @property
    def model_free_slot(self):
        return getattr(self.model, "free_slot", None)

    def append_decoded(self, slots: list[int], rows: list[list[int]]) -> None:
        """Commit tokens the target decoded alone (a target-only round). Whatever of
        pending + rows the cache does not hold stays pending: on the target (whose decode
        steps cached all but the last) that is the last token; on the draft, all of them."""
        for slot, row in zip(slots, rows):
            state = self.slots[slot]
            state.committed += len(row)
            uncached = state.committed - state.cache_len     # >= 1
            state.pending = (state.pending + row)[-uncached:]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._check_slot(slot)
            self.slots[slot] = SlotState()
            self.carried.pop(slot, None)
            if self.model_free_slot is not None:
                self.model_free_slot(slot)


class DraftShard(ModelShard):
    """Besides proposing on command, the draft can propose the next round ahead of time
    (`propose_ahead`, right after a commit): the GPU then drafts while the verdict travels to
    the orchestrator and the next command travels back. A round that matches (same slots,
    k no larger) takes those proposals; anything else restores the slots' states first
    (rollback is a length update, stale KV positions are overwritten)."""

    ahead: DraftAhead | None = None

    @property
    def windows(self) -> dict:
        """slot -> its next window (runtime.worker.overlap.DraftWindow)."""
        return self.carried

    def propose_ahead(self, slots: list[int], k: int) -> None:
        saved = self._save(slots)
        try:
            tokens, probs = self.propose(slots, k)
        except ValueError:     # a slot's cache is full: this round will not happen
            self._restore(slots, saved)
            return
        self.ahead = DraftAhead(slots, tokens, probs, saved)

    def take_ahead(self, slots: list[int], k: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The proposals made ahead for exactly these slots: their first k, or all of them
        continued to k; None (after rolling back) for other slots."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        if ahead.slots != slots:
            self._restore(ahead.slots, ahead.saved)
            return None
        tokens, probs = ahead.tokens, ahead.probs
        if k <= tokens.shape[1]:
            return tokens[:, :k], None if probs is None else probs[:, :k]
        return self._continue(slots, list(tokens.unbind(1)),
                              [] if probs is None else list(probs.unbind(1)), k,
                              self.sampling(slots), self.committed_index(slots))

    def drop_ahead(self) -> None:
        self.take_ahead([], 0)

    def propose(self, slots: list[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode k tokens per slot: tokens [B, k] on the device and, when sampling, the
        distributions q [B, k, V] they were drawn from."""
        pending = [self.slots[s].pending for s in slots]
        logits = self.forward_rows(slots, pending)                       # [B, T, V]
        if all(len(p) == 1 for p in pending):
            logits = logits[:, 0]                                         # [B, V]
        else:
            last = to_device([len(p) - 1 for p in pending], torch.long, self.device)
            logits = logits[torch.arange(len(slots), device=self.device), last]  # [B, V]
        sampling, index = self.sampling(slots), self.committed_index(slots)   # index [B]
        token, q = draft_choose(logits, sampling, index, self.acceptance)
        return self._continue(slots, [token], [] if q is None else [q], k, sampling, index)

    def _continue(self, slots: list[int], tokens: list[torch.Tensor],
                  probs: list[torch.Tensor], k: int, sampling: BatchSampling,
                  index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode from the proposals so far (tokens [B] each, their q [B, V] when sampling)
        until there are k: tokens [B, k], q [B, k, V] or None. index [B]: sequence index of
        each row's first proposal."""
        for i in range(len(tokens), k):
            logits = self._step(slots, tokens[-1][:, None])[:, -1]        # [B, V]
            token, q = draft_choose(logits, sampling, index + i, self.acceptance)
            tokens.append(token)
            if q is not None:
                probs.append(q)
        q_all = torch.stack(probs, dim=1) if probs else None              # [B, k, V]
        return torch.stack(tokens, dim=1), q_all                          # [B, k]

    def commit(self, slots: list[int], draft_tokens: list[list[int]], accepted: list[int],
               next_tokens: list[int]) -> None:
        k = len(draft_tokens[0])
        for slot, drafts, a, nxt in zip(slots, draft_tokens, accepted, next_tokens):
            state = self.slots[slot]
            n = state.committed
            state.cache_len = n + min(a, k - 1)
            state.pending = [drafts[k - 1], nxt] if a == k else [nxt]
            state.committed = n + a + 1


class TargetShard(ModelShard):
    """With a vocab-parallel target (`vocab_parallel` set), the model returns this rank's
    vocab slice: greedy batches pick the target's tokens with a distributed argmax (two
    numbers per position cross the group); sampled batches gather the full distribution."""

    vocab_parallel = None   # parallel.vocab.VocabParallel, or None when logits are full

    @property
    def held(self) -> dict:
        """slot -> logits [V(local)] of its next token, held after a kept overlapped round
        (the slot then has no pending token; runtime.worker.overlap)."""
        return self.carried

    def verify(self, slots: list[int], draft_tokens: torch.Tensor,
               draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over pending + k draft tokens; returns (accepted [B], next_token [B])."""
        pending = to_device([self.slots[s].pending for s in slots], torch.long, self.device)
        ids = torch.cat([pending, draft_tokens], dim=1)                   # [B, k+1]
        logits = self._step(slots, ids)                                   # [B, k+1, V(local)]
        return self._choose(draft_tokens, logits, self.sampling(slots),
                            self.committed_index(slots), draft_probs)

    def _choose(self, draft_tokens: torch.Tensor, logits: torch.Tensor,
                sampling: BatchSampling, first_index: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B], next_token [B]) from the target's logits [B, k+1, V(local)]."""
        if self.vocab_parallel is not None:
            if sampling.greedy:
                return accept_choices(draft_tokens, self.vocab_parallel.argmax(logits))
            logits = self.vocab_parallel.gather(logits)                   # [B, k+1, V]
        return target_verify(draft_tokens, logits, sampling, first_index, self.acceptance,
                             draft_probs)

    def decode(self, slots: list[int], steps: int) -> torch.Tensor:
        """`steps` decode steps with no draft: each appends the pending token and picks the
        next one as verify would with every draft rejected (k = 0). Tokens [B, steps] stay
        on the device (no host sync); commit them with append_decoded. Steps decoded ahead
        for these slots (decode_ahead) are taken first."""
        pending = [self.slots[s].pending for s in slots]
        if any(len(p) != 1 for p in pending):
            raise RuntimeError("target-only decode needs exactly one pending token per slot")
        done = self._take_ahead(slots, steps)                             # [B, m], m <= steps
        token = to_device(pending, torch.long, self.device) if done is None else done[:, -1:]
        tokens = [] if done is None else [done]
        first = done.shape[1] if done is not None else 0
        if first < steps:
            tokens += self._decode_steps(slots, token, first, steps - first)
        return torch.cat(tokens, dim=1)                                   # [B, steps]

    def _decode_steps(self, slots: list[int], token: torch.Tensor, done: int, steps: int
                      ) -> list[torch.Tensor]:
        """`steps` more decode steps after `done` of them, feeding token [B, 1] first."""
        no_drafts = torch.zeros(len(slots), 0, dtype=torch.long, device=self.device)
        sampling, first = self.sampling(slots), self.committed_index(slots) + done
        argmax = None
        if sampling.greedy:   # what _choose takes with no drafts, in one kernel
            argmax = self.vocab_parallel.argmax if self.vocab_parallel is not None else \
                (lambda logits: logits.argmax(dim=-1))
        tokens = []
        for i in range(steps):
            logits = self._step(slots, token)                             # [B, 1, V(local)]
            if argmax is not None:
                token = argmax(logits)                                    # [B, 1]
            else:
                token = self._choose(no_drafts, logits, sampling, first + i, None)[1][:, None]
            tokens.append(token)
        return tokens

    # --- decoding ahead: the next target-only round's first steps while control travels -
    ahead: TargetAhead | None = None

    def decode_ahead(self, slots: list[int], steps: int) -> None:
        """Queue `steps` decode steps of a target-only round that has not been asked for
        yet, right after the last one was committed. The slots' states are left as they
        were (only KV positions past their lengths are written): the next target-only
        round for the same slots in the same states takes the tokens (decode); anything
        else drops them."""
        self.ahead = None
        saved = self._save(slots)
        try:
            tokens = self.decode(slots, steps)
        except (ValueError, RuntimeError):  # a full cache, no single pending token: not now
            return
        finally:
            self._restore(slots, saved)
        self.ahead = TargetAhead(slots, tokens, self._save(slots))

    def _take_ahead(self, slots: list[int], steps: int) -> torch.Tensor | None:
        """The first min(steps, n) tokens decoded ahead, with the slots' cache lengths
        advanced over them, if they were decoded for exactly these slots in these states."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead.slots != slots or self._save(slots) != ahead.states:
            return None
        taken = min(steps, ahead.tokens.shape[1])
        for slot in slots:
            self.slots[slot].cache_len += taken
        return ahead.tokens[:, :taken]

    def drop_ahead(self) -> None:
        self.ahead = None

    def commit(self, slots: list[int], accepted: list[int], next_tokens: list[int]) -> None:
        for slot, a, nxt in zip(slots, accepted, next_tokens):
            state = self.slots[slot]
            n = state.committed
            state.cache_len = n + a
            state.pending = [nxt]
            state.committed = n + a + 1
