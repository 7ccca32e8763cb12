"""Acceptance rules: how many draft tokens the target keeps, and its own next token."""
from __future__ import annotations

import torch


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: tokens` under greedy decoding.

    draft_tokens: [B, k] the draft's proposals d_1..d_k
    target_logits: [B, k+1, V] the target's logits after the pending token and after each d_i
    returns accepted [B] (number of leading d_i equal to the target's argmax, 0..k) and
            next_token [B] (the target's argmax after the accepted prefix: the correction,
            or the bonus token when all k were accepted).
    """
    return accept_choices(draft_tokens, target_logits.argmax(dim=-1))


def accept_choices(draft_tokens: torch.Tensor, target_choice: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance from the target's own choices [B, k+1] (e.g. a vocab-parallel
    argmax); same returns as greedy_accept."""
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :k]).to(torch.int64)     # [B, k]
    accepted = matches.cumprod(dim=1).sum(dim=1)                         # [B]
    next_token = target_choice.gather(1, accepted[:, None]).squeeze(1)   # [B]
    return accepted, next_token
