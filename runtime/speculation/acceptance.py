"""Acceptance rules: how many draft tokens the target keeps, and its own next token
(Leviathan et al. 2023, Chen et al. 2023), greedy and sampled side by side.

- greedy_accept / accept_choices: greedy decoding (either acceptance mode): keep draft tokens
  while they equal the target's argmax.
- accept_tokens: `acceptance: tokens` - the target samples its own token at every position and
  keeps draft tokens while they equal its samples.
- accept_rejection: `acceptance: logits` - modified rejection sampling with p (target) and
  q (draft).

Shapes: B requests, k draft tokens, V vocabulary. Batched tensor code without host
synchronisation; given the same uniforms the results do not depend on the batch composition.
"""

from __future__ import annotations

import torch

from runtime.speculation.sampling import sample_from


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: tokens` under greedy decoding.

    draft_tokens: [B, k] the draft's proposals d_1..d_k
    target_logits: [B, k+1, V] the target's logits after the pending token and after each d_i
    returns accepted [B] (number of leading d_i equal to the target's argmax, 0..k) and
            next_token [B] (the target's argmax after the accepted prefix: the correction,
            or the bonus token when all k were accepted).
    """
    return accept_choices(draft_tokens, target_logits.argmax(dim=-1))


def accept_choices(
    draft_tokens: torch.Tensor, target_choice: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance from the target's own choices [B, k+1] (e.g. a vocab-parallel
    argmax); same returns as greedy_accept."""
    k = draft_tokens.shape[1]
    accepted = count_accepted(draft_tokens == target_choice[:, :k])  # [B]
    next_token = target_choice.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token


def gather_token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs: [B, k, V], tokens: [B, k] -> [B, k] probability of each token."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def count_accepted(accept: torch.Tensor) -> torch.Tensor:
    """accept: [B, k] bool per draft token -> [B] int64 length of the accepted prefix (0..k)."""
    return accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def accept_tokens(
    draft_tokens: torch.Tensor, target_probs: torch.Tensor, u_target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: tokens` under sampling (lossless).

    The target samples t_i from p_i at every position; draft tokens are kept while d_i == t_i,
    and next_token is t at the first mismatch (or the bonus t_k). The emitted tokens are exactly
    what the target alone would sample with the same uniforms, whatever the draft proposed.

    draft_tokens: [B, k]; target_probs: [B, k+1, V] warped; u_target: [B, k+1]
    returns accepted [B] in 0..k and next_token [B]
    """
    k = draft_tokens.shape[1]
    target_tokens = sample_from(target_probs, u_target)  # [B, k+1]
    accepted = count_accepted(draft_tokens == target_tokens[:, :k])  # [B]
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token


def rejection_test(
    p_draft: torch.Tensor, q_draft: torch.Tensor, u_accept: torch.Tensor
) -> torch.Tensor:
    """Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); q_i(d_i) = 0 accepts.

    p_draft, q_draft, u_accept: [B, k] -> [B, k] bool. p >= q always accepts (u < 1).
    """
    return (q_draft <= 0) | (u_accept < p_draft / q_draft)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; where that is all zero (p == q) returns p.

    p, q: [..., V] -> [..., V] float32 (or float64)
    """
    r = (p - q).clamp(min=0)  # [..., V]
    total = r.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


def sample_correction(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accepted: torch.Tensor,
    u_sample: torch.Tensor,
) -> torch.Tensor:
    """The token after the accepted prefix: from norm(max(0, p_a - q_a)) after a rejection at a,
    from p_k (bonus) when all k were accepted.

    draft_probs: [B, k, V] q; target_probs: [B, k+1, V] p; accepted: [B]; u_sample: [B, k+1]
    returns [B] int64
    """
    B, k, V = draft_probs.shape
    idx = accepted.view(B, 1, 1).expand(B, 1, V)  # [B, 1, V]
    p_a = target_probs.gather(1, idx)  # [B, 1, V]
    if k == 0:
        q_a = torch.zeros_like(p_a)
    else:
        q_a = draft_probs.gather(1, idx.clamp(max=k - 1)).to(p_a.dtype)  # [B, 1, V]
        q_a = torch.where((accepted < k).view(B, 1, 1), q_a, 0.0)  # bonus: q = 0
    r = residual_probs(p_a.to(torch.float32), q_a.to(torch.float32))  # [B, 1, V]
    u = u_sample.gather(1, accepted[:, None])  # [B, 1]
    return sample_from(r, u).squeeze(1)


def accept_rejection(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: logits`: modified rejection sampling; emitted tokens are distributed exactly
    as the target's sampling. With one-hot p and q it is greedy matching.

    draft_tokens: [B, k] sampled from draft_probs; draft_probs: [B, k, V] q (warped);
    target_probs: [B, k+1, V] p (warped); u_accept: [B, k]; u_sample: [B, k+1]
    returns accepted [B] in 0..k and next_token [B]
    """
    k = draft_tokens.shape[1]
    p_d = gather_token_probs(target_probs[:, :k], draft_tokens)  # [B, k]
    q_d = gather_token_probs(draft_probs, draft_tokens)  # [B, k]
    accepted = count_accepted(rejection_test(p_d, q_d, u_accept))  # [B]
    next_token = sample_correction(draft_probs, target_probs, accepted, u_sample)
    return accepted, next_token
