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
from runtime.speculation.acceptance import accept_rejection, accept_tokens, greedy_accept
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
    greedy: bool  # every row greedy: argmax fast path, no draft probabilities
    filtered: bool = True  # some row uses top-k or top-p (needs the vocabulary sort)

    @classmethod
    def of(cls, params: list[Sampling], device: torch.device) -> BatchSampling:
        """The settings of a batch's rows (one request's each: runtime.control.commands)."""
        temps = [p.temperature for p in params]
        return cls(
            temperature=to_device(temps, torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            seed=to_device([p.seed for p in params], torch.long, device),
            greedy=all(t == 0 for t in temps),
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, n, V] logits -> [B, n, V] float32 sampling distributions."""
        return warp_probs(logits, self.temperature, self.top_k, self.top_p, self.filtered)


def draft_choose(
    logits: torch.Tensor,
    sampling: BatchSampling,
    index: torch.Tensor,
    acceptance: str,
    vocab: DraftVocab | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] for the tokens at sequence index `index` [B] -> token [B] and q [B, V]
    (None when the whole batch is greedy). With `vocab` (a draft padded differently from
    the target) the choice is among ids < vocab.propose and q is [B, vocab.width].

    Under `tokens` acceptance the draft samples with the target's own uniforms: the output is
    the target's samples whatever the draft proposes, and coupled uniforms make the draft's
    sample coincide with the target's more often. `logits` acceptance needs an independent
    draft sample (its own stream)."""
    if vocab is not None:
        logits = vocab.restrict(logits)  # [B, propose]
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    q = sampling.warp(logits[:, None])  # [B, 1, V]
    stream = rng.STREAM_TARGET if acceptance == "tokens" else rng.STREAM_DRAFT
    u = rng.uniform(sampling.seed, index[:, None], stream)  # [B, 1]
    token = sample_from(q, u)[:, 0]
    return token, q[:, 0] if vocab is None else vocab.widen(q[:, 0])


def target_verify(
    draft_tokens: torch.Tensor,
    logits: torch.Tensor,
    sampling: BatchSampling,
    first_index: torch.Tensor,
    acceptance: str,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, k], target logits [B, k+1, V]; first_index [B] = sequence index of
    the first token decided (= committed length). Returns accepted [B], next_token [B]."""
    if sampling.greedy:
        return greedy_accept(draft_tokens, logits)
    k = draft_tokens.shape[1]
    index = first_index[:, None] + torch.arange(k + 1, device=logits.device)  # [B, k+1]
    p = sampling.warp(logits)  # [B, k+1, V]
    u_target = rng.uniform(sampling.seed, index, rng.STREAM_TARGET)  # [B, k+1]
    if acceptance == "tokens":
        return accept_tokens(draft_tokens, p, u_target)
    if draft_probs is None:
        if k > 0:
            raise ValueError("acceptance 'logits' needs the draft's probabilities")
        draft_probs = p.new_zeros(*draft_tokens.shape, p.shape[-1])  # [B, 0, V]
    u_accept = rng.uniform(sampling.seed, index[:, :k], rng.STREAM_ACCEPT)  # [B, k]
    return accept_rejection(draft_tokens, draft_probs, p, u_accept, u_target)
