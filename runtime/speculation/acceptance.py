"""Acceptance rules: how many draft tokens the target keeps, and its own next token
(Leviathan et al. 2023, Chen et al. 2023), greedy and sampled side by side.

- greedy_accept / accept_choices: greedy decoding (either acceptance mode): keep draft tokens
  while they equal the target's argmax.
- accept_tokens: `acceptance: tokens` - the target samples its own token at every position and
  keeps draft tokens while they equal its samples.
- accept_rejection: `acceptance: logits`, `verification: token` - modified rejection sampling
  with p (target) and q (draft), token by token: a window stops at its first rejection.
- accept_block: `acceptance: logits`, `verification: block` - block verification (Sun et al.,
  "Block Verification Accelerates Speculative Decoding", ICLR 2025, arXiv 2403.10444): the
  window is judged as a whole from the same p and q; exact, and never fewer tokens a round in
  expectation.

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


def residual_probs(
    p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(max(0, w * p - q)) over the last dim (w = 1 without `weight`); where that is all
    zero (p == q) returns p.

    p, q: [..., V]; weight: [...] or None -> [..., V] float32 (or float64)
    """
    scaled = p if weight is None else weight.unsqueeze(-1) * p  # [..., V]
    r = (scaled - q).clamp(min=0)  # [..., V]
    total = r.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


def sample_correction(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accepted: torch.Tensor,
    u_sample: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token after the accepted prefix: from norm(max(0, w * p_a - q_a)) when a < k, from
    p_k (bonus) when all k were accepted. w = 1 (the token rule) unless `weight` [B] gives
    it (the block rule's p_a, see accept_block).

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
    w = None if weight is None else weight.to(torch.float32)[:, None]  # [B, 1]
    r = residual_probs(p_a.to(torch.float32), q_a.to(torch.float32), w)  # [B, 1, V]
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


# ---------------------------------------------------------------- block verification
# Sun et al. 2025, Algorithm 2, with the draft X_1..X_k, the draft's distributions
# q_i = M_s(. | c, X_1..X_i) (draft_probs[:, i], i < k) and the target's p_i = M_b(. | c,
# X_1..X_i) (target_probs[:, i], i <= k):
#   weights (the paper's p_i):  w_0 = 1,  w_i = min(1, w_{i-1} * p_{i-1}(X_i) / q_{i-1}(X_i))
#   residual mass:              s_i = sum_x max(0, w_i * p_i(x) - q_i(x))
#   keep probabilities:         h_i = s_i / (s_i + 1 - w_i) for i < k,  h_k = w_k
#   accepted length:            tau = the largest i in 1..k with eta_i < h_i, else 0
#                               (eta_i uniform in [0, 1): each holds with probability h_i)
#   next token:                 Y ~ p_k when tau = k, else the residual distribution
#                               p_res(x) = max(0, w_tau * p_tau(x) - q_tau(x)) / s_tau
# (tau = 0 is the token rule's first rejection: w_0 = 1.) s_i = 0 with w_i = 1 gives 0 / 0:
# h_i is 0 there (a prefix whose residual is empty is never where a window ends).


def block_weights(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The weights w_0..w_k [B, k+1] from p_draft, q_draft [B, k] (target's and draft's
    probability of each draft token). A token the draft could not propose (q = 0) has the
    ratio +inf (accepted, as the token rule does) unless the target gives it 0 too; a weight
    of 0 stays 0."""
    inf = torch.full_like(p_draft, float("inf"))
    ratio = torch.where(q_draft > 0, p_draft / q_draft, torch.where(p_draft > 0, inf, 0.0))
    weights = [torch.ones_like(p_draft[:, 0])]  # w_0 [B]
    for i in range(p_draft.shape[1]):
        last = weights[-1]
        weights.append(torch.where(last > 0, (last * ratio[:, i]).clamp(max=1.0), 0.0))
    return torch.stack(weights, dim=1)  # [B, k+1]


def block_keep_probs(
    weights: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """h_1..h_k [B, k] from the weights [B, k+1], q [B, k, V] and p [B, k+1, V]."""
    k = draft_probs.shape[1]
    w = weights[:, 1:k]  # [B, k-1] w_1..w_{k-1}
    p, q = target_probs[:, 1:k].to(torch.float32), draft_probs[:, 1:].to(torch.float32)
    mass = (w.unsqueeze(-1) * p - q).clamp(min=0).sum(dim=-1)  # [B, k-1] s_1..s_{k-1}
    denominator = mass + (1.0 - w)
    h = torch.where(mass > 0, mass / torch.where(mass > 0, denominator, 1.0), 0.0)
    return torch.cat([h, weights[:, k:]], dim=1)  # [B, k]: h_k = w_k


def accept_block(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: logits` under `verification: block` (equations above): emitted tokens are
    distributed exactly as the target's sampling (the paper's Theorem 1), and the expected
    accepted length is at least accept_rejection's (Theorem 2). With one-hot p and q it is
    greedy matching.

    The outcome depends on every eta_i and every draft token of the window, not only those up
    to the last emitted position: u_accept (and the draft's own uniforms) must be fresh for
    each window (runtime.speculation.rng.window_uniform), unlike the token rule's.

    draft_tokens: [B, k] sampled from draft_probs; draft_probs: [B, k, V] q (warped);
    target_probs: [B, k+1, V] p (warped); u_accept: [B, k] eta_1..eta_k; u_sample: [B, k+1]
    returns accepted [B] in 0..k and next_token [B]
    """
    k = draft_tokens.shape[1]
    if k == 0:
        return accept_rejection(draft_tokens, draft_probs, target_probs, u_accept, u_sample)
    p_d = gather_token_probs(target_probs[:, :k], draft_tokens)  # [B, k]
    q_d = gather_token_probs(draft_probs, draft_tokens)  # [B, k]
    weights = block_weights(p_d.to(torch.float32), q_d.to(torch.float32))  # [B, k+1]
    h = block_keep_probs(weights, draft_probs, target_probs)  # [B, k]
    lengths = torch.arange(1, k + 1, device=draft_tokens.device).expand_as(h)  # [B, k]
    accepted = torch.where(u_accept < h, lengths, 0).amax(dim=1)  # [B]
    weight = weights.gather(1, accepted[:, None]).squeeze(1)  # [B] w_tau
    next_token = sample_correction(draft_probs, target_probs, accepted, u_sample, weight)
    return accepted, next_token
