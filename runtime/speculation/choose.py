"""Turning logits into tokens for one batch: the draft's proposals and the target's verdict,
greedy or sampled, under either acceptance mode.

Uniforms come from runtime.speculation.rng keyed by (request seed, absolute index of the token being
decided, stream), so every TP rank makes the same choice and a seed reproduces its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.models.runners.hostcopy import to_device
from runtime.speculation import rng
from runtime.speculation.acceptance import (
    accept_block,
    accept_rejection,
    accept_tokens,
    greedy_accept,
)
from runtime.speculation.processors import Penalties, Processing, process
from runtime.speculation.sampling import sample_from, warp_probs
from runtime.speculation.vocab import DraftVocab

if TYPE_CHECKING:
    from runtime.control.commands import Sampling


@dataclass(frozen=True)
class BatchSampling:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    seed: torch.Tensor  # [B] int64
    greedy: bool  # every row greedy: argmax (of processed logits), no draft probabilities
    filtered: bool = True  # some row uses top-k or top-p (needs the vocabulary sort)
    min_p: torch.Tensor | None = None  # [B] float32, None: no row uses min-p
    processing: Processing = Processing()  # logit_bias, min_tokens, penalties
    logprobs: int = -1  # the most top alternatives a row reports, -1: no row reports

    @classmethod
    def of(
        cls,
        params: list[Sampling],
        device: torch.device,
        vocab: int = 0,
        history: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> BatchSampling:
        """The settings of a batch's rows (one request's each: runtime.control.commands).
        vocab: the token ids' range (0: no processing); history: the rows' output counts and
        seen tokens [B, V] (TokenHistory), needed when a row is penalised."""
        temps = [p.temperature for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            temperature=to_device(temps, torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            seed=to_device([p.seed for p in params], torch.long, device),
            greedy=all(t == 0 for t in temps),
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            min_p=to_device(min_p, torch.float32, device) if any(min_p) else None,
            processing=processing_of(params, device, vocab, history) if vocab else Processing(),
            logprobs=max(p.logprobs for p in params) if params else -1,
        )

    def argmax_suffices(self, mask: torch.Tensor | None = None) -> bool:
        """Greedy rows whose choice is the argmax of the raw logits: nothing processes or
        masks them and no row reports logprobs (a vocab-parallel target then needs no
        gather)."""
        return self.greedy and not self.processing.active and self.logprobs < 0 and mask is None

    def process(
        self,
        logits: torch.Tensor,
        index: torch.Tensor,
        window: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, n, V] logits of the tokens at sequence indices `index` [B, n] -> processed
        (runtime.speculation.processors; the logits themselves when no row is); mask: the
        grammars' [B, n, V]."""
        if not self.processing.active and mask is None:
            return logits
        return process(logits, self.processing, index, window, mask)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """[B, n, V] processed logits -> [B, n, V] float32 sampling distributions."""
        return warp_probs(
            scores, self.temperature, self.top_k, self.top_p, self.filtered, self.min_p
        )


def processing_of(
    params: list[Sampling],
    device: torch.device,
    vocab: int,
    history: tuple[torch.Tensor, torch.Tensor] | None,
) -> Processing:
    """The rows' logits processors as tensors [B, V] (a part no row uses: None)."""
    B = len(params)
    bias = stop = min_tokens = start = penalties = None
    if any(p.bias_ids for p in params):
        bias = _scatter(
            torch.zeros(B, vocab, dtype=torch.float32, device=device),
            [(i, t, b) for i, p in enumerate(params) for t, b in zip(p.bias_ids, p.bias_values)],
        )
    if any(p.min_tokens > 0 and p.stop_ids for p in params):
        stop = _scatter(
            torch.zeros(B, vocab, dtype=torch.bool, device=device),
            [(i, t, True) for i, p in enumerate(params) for t in p.stop_ids],
        )
        min_tokens = to_device([p.min_tokens for p in params], torch.long, device)
        start = to_device([p.output_start for p in params], torch.long, device)
    if any(p.penalised for p in params):
        if history is None:
            raise ValueError("penalties need the rows' token history")
        penalties = Penalties(
            repetition=to_device([p.repetition for p in params], torch.float32, device),
            frequency=to_device([p.frequency for p in params], torch.float32, device),
            presence=to_device([p.presence for p in params], torch.float32, device),
            output_counts=history[0],
            seen=history[1],
        )
    return Processing(bias, stop, min_tokens, start, penalties)


def _scatter(table: torch.Tensor, cells: list[tuple[int, int, float | bool]]) -> torch.Tensor:
    """table [B, V] with the (row, token id, value) cells set (ids past V ignored)."""
    cells = [c for c in cells if c[1] < table.shape[1]]
    if cells:
        rows, ids, values = zip(*cells)
        table.index_put_(
            (
                to_device(list(rows), torch.long, table.device),
                to_device(list(ids), torch.long, table.device),
            ),
            to_device(list(values), table.dtype, table.device),
        )
    return table


def draft_choose(
    logits: torch.Tensor,
    sampling: BatchSampling,
    index: torch.Tensor,
    acceptance: str,
    vocab: DraftVocab | None = None,
    window: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] for the tokens at sequence index `index` [B] -> token [B] and q [B, V]
    (None when the whole batch is greedy), through the rows' processors (`window` [B, m]: the
    proposals before this one, in their history). With `vocab` (a draft padded differently
    from the target) the choice is among ids < vocab.propose and q is [B, vocab.width].

    Under `tokens` acceptance the draft samples with the target's own uniforms: the output is
    the target's samples whatever the draft proposes, and coupled uniforms make the draft's
    sample coincide with the target's more often. `logits` acceptance needs an independent
    draft sample (its own stream); under `verification: block` (`start` [B]: the first index
    of the window this proposal belongs to) that sample is keyed by its window
    (rng.window_uniform), as the block rule needs."""
    if vocab is not None:
        logits = vocab.restrict(logits)  # [B, propose]
    scores = sampling.process(logits[:, None], index[:, None], window, mask)  # [B, 1, V]
    if sampling.greedy:
        return scores[:, 0].argmax(dim=-1), None
    q = sampling.warp(scores)  # [B, 1, V]
    token = sample_from(q, _draft_uniform(sampling.seed, index, acceptance, start))[:, 0]
    return token, q[:, 0] if vocab is None else vocab.widen(q[:, 0])


def _draft_uniform(
    seed: torch.Tensor, index: torch.Tensor, acceptance: str, start: torch.Tensor | None
) -> torch.Tensor:
    """[B, 1] uniforms of the draft's samples at index [B] (draft_choose)."""
    if acceptance == "tokens":
        return rng.uniform(seed, index[:, None], rng.STREAM_TARGET)
    if start is None:
        return rng.uniform(seed, index[:, None], rng.STREAM_DRAFT)
    return rng.window_uniform(seed, start, index[:, None], rng.STREAM_BLOCK_DRAFT)


def target_verify(
    draft_tokens: torch.Tensor,
    logits: torch.Tensor,
    sampling: BatchSampling,
    first_index: torch.Tensor,
    acceptance: str,
    draft_probs: torch.Tensor | None,
    earlier: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    verification: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, k], target logits [B, k+1, V]; first_index [B] = sequence index of
    the first token decided (= committed length, the window's start). `verification`
    (token | block) picks the rule of `logits` acceptance. Position i's logits are processed with
    the first i drafts in their history (after `earlier` [B, m], tokens decided before the
    window and not yet committed: a target-only round's earlier steps), and masked by the
    grammars' `mask` [B, k+1, V] at each position. Returns accepted [B], next_token [B]."""
    k = draft_tokens.shape[1]
    index = first_index[:, None] + torch.arange(k + 1, device=logits.device)  # [B, k+1]
    window = draft_tokens if earlier is None else torch.cat([earlier, draft_tokens], dim=1)
    scores = sampling.process(logits, index, window, mask)  # [B, k+1, V]
    if sampling.greedy:
        return greedy_accept(draft_tokens, scores)
    p = sampling.warp(scores)  # [B, k+1, V]
    u_target = rng.uniform(sampling.seed, index, rng.STREAM_TARGET)  # [B, k+1]
    if acceptance == "tokens":
        return accept_tokens(draft_tokens, p, u_target)
    if draft_probs is None:
        if k > 0:
            raise ValueError("acceptance 'logits' needs the draft's probabilities")
        draft_probs = p.new_zeros(*draft_tokens.shape, p.shape[-1])  # [B, 0, V]
    if verification == "block":  # eta_1..eta_k [B, k], fresh for each window
        eta = rng.window_uniform(sampling.seed, first_index, index[:, :k], rng.STREAM_BLOCK_ACCEPT)
        return accept_block(draft_tokens, draft_probs, p, eta, u_target)
    u_accept = rng.uniform(sampling.seed, index[:, :k], rng.STREAM_ACCEPT)  # [B, k]
    return accept_rejection(draft_tokens, draft_probs, p, u_accept, u_target)
