"""The target's model shard on a worker (runtime.worker.shards.ModelShard): verification of
the draft's proposals, the first token of a prompt, target-only decode steps and their work
ahead, and the held logits of overlapped rounds."""

from __future__ import annotations

from typing import cast

import torch

from runtime.control.commands import Sampling
from runtime.models.runners.hostcopy import to_device
from runtime.speculation.acceptance import accept_choices
from runtime.speculation.choose import BatchSampling, target_verify
from runtime.speculation.processors import token_logprobs
from runtime.worker.shards import ModelShard
from runtime.worker.slot_state import Extension


def _scores(params: list[Sampling] | None) -> bool:
    """Whether a row of a prefill asks for its prompt's logprobs."""
    return params is not None and any(p.prompt_logprobs >= 0 for p in params)


class TargetShard(ModelShard):
    """With a vocab-parallel target (`vocab_parallel` set), the model returns this rank's
    vocab slice: greedy batches pick the target's tokens with a distributed argmax (two
    numbers per position cross the group); sampled batches gather the full distribution.
    Work ahead: the next target-only round's first decode steps (`decode_ahead`)."""

    vocab_parallel = None  # parallel.vocab.VocabParallel, or None when logits are full
    ahead: Extension | None = None
    # this command's logprob records [B, n, 1 + 2N] in position order (take_logprobs)
    reported: list[torch.Tensor] | None = None
    # this prefill's records of prompt tokens, per slot that asks (take_prompt_logprobs)
    prompt_reported: dict[int, list[list[float]]] | None = None

    @property
    def held(self) -> dict[int, torch.Tensor]:
        """slot -> logits [V(local)] of its next token, held after a kept overlapped round
        (the slot then has no pending token; runtime.worker.overlap)."""
        return cast("dict[int, torch.Tensor]", self.carried)

    def verify(
        self, slots: list[int], draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over pending + k draft tokens; returns (accepted [B], next_token [B])."""
        accepted, next_token, _ = self.verify_with_last(slots, draft_tokens, draft_probs)
        return accepted, next_token

    def verify_with_last(
        self, slots: list[int], draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """verify, and the logits at each slot's last position [B, V(local)] (held if the
        slot is kept). Slots that hold the logits of their first draft's position (kept
        last round) run over the k drafts alone."""
        held = [s in self.held for s in slots]
        pending = to_device([self.slots[s].pending or [0] for s in slots], torch.long, self.device)
        proposals = self.grammars.to_host(slots, draft_tokens)  # before the forward is queued
        if not any(held):
            logits = self._step(slots, torch.cat([pending, draft_tokens], dim=1))  # [B, k+1, V]
        else:
            logits = self._step_held(slots, draft_tokens, pending, held)
        mask = self.grammars.window_masks(slots, proposals)  # [B, k+1, V] or None, built on
        # the host while the forward runs
        accepted, next_token = self._choose(
            draft_tokens,
            logits,
            self.sampling(slots),
            self.committed_index(slots),
            draft_probs,
            mask=mask,
        )
        return accepted, next_token, logits[:, draft_tokens.shape[1]]

    def _step_held(
        self, slots: list[int], draft_tokens: torch.Tensor, pending: torch.Tensor, held: list[bool]
    ) -> torch.Tensor:
        """The verify forward when some slots hold their first position's logits: those feed
        their k drafts alone and take the held logits first. Logits [B, k+1, V(local)]."""
        bsz, k = draft_tokens.shape
        pad = torch.zeros(bsz, 1, dtype=torch.long, device=self.device)
        is_held = torch.tensor(held, device=self.device)[:, None]  # [B, 1]
        ids = torch.where(
            is_held, torch.cat([draft_tokens, pad], 1), torch.cat([pending, draft_tokens], 1)
        )  # [B, k+1]
        new = self._step(slots, ids, [k if h else k + 1 for h in held])  # [B, k+1, V]
        first = torch.stack(
            [self.held[s] if h else new[i, 0] for i, (s, h) in enumerate(zip(slots, held))]
        )  # [B, V]
        shifted = torch.cat([first[:, None], new[:, :k]], dim=1)  # [B, k+1, V]
        return torch.where(is_held[:, :, None], shifted, new)

    def _choose(
        self,
        draft_tokens: torch.Tensor,
        logits: torch.Tensor,
        sampling: BatchSampling,
        first_index: torch.Tensor,
        draft_probs: torch.Tensor | None,
        earlier: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B], next_token [B]) from the target's logits [B, k+1, V(local)];
        earlier: tokens decided before these positions, not committed yet (decode); mask:
        the grammars' [B, k+1, V]."""
        if self.vocab_parallel is not None:
            if sampling.argmax_suffices(mask):
                return accept_choices(draft_tokens, self.vocab_parallel.argmax(logits))
            logits = self.vocab_parallel.gather(logits)  # [B, k+1, V]
        accepted, next_token = target_verify(
            draft_tokens,
            logits,
            sampling,
            first_index,
            self.acceptance,
            draft_probs,
            earlier,
            mask,
            self.verification,
        )
        if sampling.logprobs >= 0:
            chosen = torch.cat([draft_tokens, next_token[:, None]], dim=1)  # [B, k+1]
            chosen = chosen.scatter(1, accepted[:, None], next_token[:, None])
            self._report(token_logprobs(logits, chosen, sampling.logprobs))
        return accepted, next_token

    def _report(self, record: torch.Tensor) -> None:
        if self.reported is None:
            self.reported = []
        self.reported.append(record)

    def take_logprobs(self, lengths: list[int]) -> list[list[list[float]]]:
        """The logprob records of this command's committed tokens (the first lengths[i] of
        row i), [] when no row asked; the records are dropped."""
        reported, self.reported = self.reported, None
        if not reported:
            return []
        rows = torch.cat(reported, dim=1).tolist()  # [B, n, 1 + 2N]
        return [row[:n] for row, n in zip(rows, lengths)]

    def commit(self, slots: list[int], accepted: list[int], next_tokens: list[int]) -> None:
        for slot, a, nxt in zip(slots, accepted, next_tokens):
            self.slots.commit(slot, a + 1, a, [nxt])

    def commit_held(
        self,
        slots: list[int],
        accepted: list[int],
        next_tokens: list[int],
        held: list[bool],
        last_logits: torch.Tensor,
    ) -> None:
        """An overlapped round's verdict: held slots commit their k drafts and hold the last
        position's logits [B, V(local)] (no pending token); the others commit as in a plain
        round (bonus token included)."""
        for i, slot in enumerate(slots):
            self.held.pop(slot, None)
            if held[i]:
                self.slots.commit(slot, accepted[i], accepted[i], [])
                self.held[slot] = last_logits[i].clone()  # the step's output is reused
            else:
                self.commit([slot], [accepted[i]], [next_tokens[i]])

    def prefill_first(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[Sampling] | None = None,
        cached: list[int] | None = None,
        tables: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Start these sequences and feed all their tokens (prompts: from position
        cached[i] on, as ModelShard.prefill), the last too: each one's first output token
        [B, 1] on the device, the target's choice at the index after the prompt (what a
        round rejecting every draft takes). Commit it with append_decoded (on the draft
        too)."""
        self._start(slots, prompts, params, cached, tables)
        ids, n_valid = self._ragged(prompts)
        if _scores(params):  # every position's logits: the prompt's logprobs
            full = self._score(slots, prompts, params, self._step(slots, ids, n_valid))
            last = to_device([n - 1 for n in n_valid], torch.long, self.device)
            logits = full[torch.arange(len(slots), device=self.device), last]  # [B, V(local)]
        else:
            logits = self._step_last(slots, ids, n_valid)  # [B, V]
        mask = self.grammars.step_masks(slots)
        return self._pick(
            logits[:, None], self.sampling(slots), self.committed_index(slots), mask=mask
        )

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[Sampling] | None = None,
        cached: list[int] | None = None,
        tables: list[list[int]] | None = None,
        through: bool = False,
    ) -> None:
        """ModelShard.prefill; rows that ask for prompt logprobs get their tokens' records
        (take_prompt_logprobs): every position's logits are kept for them."""
        if not _scores(params):
            return super().prefill(slots, prompts, params, cached, tables, through)
        self._start(slots, prompts, params, cached, tables)
        rows = [p if through else p[:-1] for p in prompts]  # a chunk has 2 tokens at least
        self._score(slots, prompts, params, self._step(slots, *self._ragged(rows)))

    def _score(
        self,
        slots: list[int],
        prompts: list[list[int]],
        params: list[Sampling] | None,
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """Record the target's logprobs of each asking row's tokens after its first (the
        logits [B, T, V(local)] at position j score token j + 1); returns the logits."""
        assert params is not None  # _scores(params)
        full = logits if self.vocab_parallel is None else self.vocab_parallel.gather(logits)
        width = max(len(p) for p in prompts) - 1
        if width <= 0:
            return logits
        nxt = to_device(
            [p[1:] + [0] * (width + 1 - len(p)) for p in prompts], torch.long, self.device
        )
        top = max(p.prompt_logprobs for p in params)
        records = token_logprobs(full[:, :width], nxt, top).tolist()  # [B, width, 1 + 2N]
        if self.prompt_reported is None:
            self.prompt_reported = {}
        for slot, prompt, sampling, row in zip(slots, prompts, params, records):
            if sampling.prompt_logprobs >= 0:
                self.prompt_reported[slot] = row[: len(prompt) - 1]
        return logits

    def take_prompt_logprobs(self, slots: list[int]) -> list[list[list[float]]]:
        """This prefill's prompt records per slot ([] for a slot that asked none), [] when no
        slot asked; the records are dropped."""
        reported, self.prompt_reported = self.prompt_reported, None
        if not reported:
            return []
        return [reported.get(slot, []) for slot in slots]

    def _pick(
        self,
        logits: torch.Tensor,
        sampling: BatchSampling,
        index: torch.Tensor,
        earlier: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The target's token at sequence index `index` [B] from its logits [B, 1, V(local)]
        with no drafts to test: [B, 1]. earlier, mask: as _choose's."""
        if sampling.argmax_suffices(mask):
            if self.vocab_parallel is not None:
                return self.vocab_parallel.argmax(logits)
            return logits.argmax(dim=-1)
        no_drafts = torch.zeros(logits.shape[0], 0, dtype=torch.long, device=self.device)
        return self._choose(no_drafts, logits, sampling, index, None, earlier, mask)[1][:, None]

    # --- target-only rounds ----------------------------------------------------------------
    def decode(self, slots: list[int], steps: int) -> torch.Tensor:
        """`steps` decode steps with no draft: each appends the pending token and picks the
        next one as verify would with every draft rejected (k = 0). Tokens [B, steps] stay
        on the device (no host sync); commit them with append_decoded. Steps decoded ahead
        for these slots (decode_ahead) are taken first."""
        pending = [self.slots[s].pending for s in slots]
        if any(len(p) != 1 for p in pending):
            raise RuntimeError("target-only decode needs exactly one pending token per slot")
        done = self._take_ahead(slots, steps)  # [B, m], m <= steps
        token = to_device(pending, torch.long, self.device) if done is None else done[:, -1:]
        tokens = [] if done is None else [done]
        first = done.shape[1] if done is not None else 0
        if first < steps:
            tokens = self._decode_steps(slots, token, tokens, steps - first)
        return torch.cat(tokens, dim=1)  # [B, steps]

    def _decode_steps(
        self, slots: list[int], token: torch.Tensor, tokens: list[torch.Tensor], steps: int
    ) -> list[torch.Tensor]:
        """`steps` more decode steps after `tokens` ([B, m] each, decoded this round and not
        committed: in the penalties' history), feeding token [B, 1] first."""
        sampling, tokens = self.sampling(slots), list(tokens)
        first = self.committed_index(slots) + sum(t.shape[1] for t in tokens)
        chosen = None  # the last step's choice on its way to the matchers
        for i in range(steps):
            logits = self._step(slots, token)  # [B, 1, V(local)]
            self.grammars.advance(slots, chosen)  # on the host, while the step runs
            earlier = torch.cat(tokens, dim=1) if tokens and sampling.processing.active else None
            mask = self.grammars.step_masks(slots)
            token = self._pick(logits, sampling, first + i, earlier, mask)  # [B, 1]
            chosen = self.grammars.to_host(slots, token[:, 0])
            tokens.append(token)
        self.grammars.rewind(slots)  # the round commits what it keeps
        return tokens

    def decode_ahead(self, slots: list[int], steps: int) -> None:
        """Queue `steps` decode steps of a target-only round that has not been asked for
        yet, right after the last one was committed. The slots' states are left as they
        were (only KV positions past their lengths are written): the next target-only
        round for the same slots in the same states takes the tokens (decode); anything
        else drops them."""
        self.ahead, marks = None, self.slots.mark(slots)
        if self.reports_logprobs(slots) or self.grammars.active:  # the round's own
            return
        try:
            tokens = self.decode(slots, steps)
        except (ValueError, RuntimeError):  # a full cache, no single pending token: not now
            return
        finally:
            self.slots.rollback(slots, marks)  # the work is the record's; states stay
        self.ahead = Extension(slots, tokens, None, marks)

    def _take_ahead(self, slots: list[int], steps: int) -> torch.Tensor | None:
        """The first min(steps, n) tokens decoded ahead, with the slots' cache lengths
        advanced over them, if they were decoded for exactly these slots in these states."""
        ahead, self.ahead = self.ahead, None
        if not self.slots.fits(ahead, slots):
            return None
        self.slots.take(ahead, steps)
        return ahead.tokens[:, :steps]

    def drop_ahead(self) -> None:
        self.ahead = None
