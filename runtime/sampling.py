"""Exact sampling core of speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

- warp_probs: logits -> the request's sampling distribution (temperature, top-k, top-p exactly
  as transformers' warpers; temperature 0 = greedy one-hot).
- sample_from: inverse-CDF sampling driven by given uniforms (see runtime/rng.py).
- accept_tokens: `acceptance: tokens` - the target samples its own token at every position and
  keeps draft tokens while they equal its samples.
- accept_rejection: `acceptance: logits` - modified rejection sampling with p (target) and
  q (draft).

Shapes: B requests, k draft tokens, V vocabulary. Everything is batched tensor code without host
synchronisation, so it runs unchanged on CPU and CUDA. Given the same uniforms the results do not
depend on the batch composition.
"""
from __future__ import annotations

import torch


def _filter_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """Mask (-inf) what TopKLogitsWarper then TopPLogitsWarper would remove, row by row.

    scores: [B, n, V] float32 temperature-scaled logits
    top_k: [B] int (0 disables); top_p: [B] float (>= 1 disables)
    """
    B, n, V = scores.shape
    # One sort serves both filters: ascending (transformers' top-p order, so its cumsum is
    # reproduced exactly), top-k removes a prefix of it. Ties are ordered deterministically,
    # higher index first, so a tie straddling the top-p boundary keeps the lower indices (as
    # argmax does); transformers' unstable torch.sort leaves that choice to the sort kernel.
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    sorted_scores, order = sorted_scores.flip(-1), order.flip(-1)              # [B, n, V]
    k = torch.where(top_k > 0, top_k, V).clamp(1, V).to(torch.int64)            # [B]
    kth = sorted_scores.gather(-1, (V - k).view(B, 1, 1).expand(B, n, 1))      # [B, n, 1]
    remove = sorted_scores < kth                                               # [B, n, V]
    sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)                         # [B, n, V]
    # transformers compares with the Python float 1 - top_p, rounded to float32 by the kernel
    threshold = (1.0 - top_p.to(torch.float64)).to(torch.float32).view(B, 1, 1)
    remove_p = cum <= threshold                                                # [B, n, V]
    remove_p[..., -1] = False                                   # min_tokens_to_keep=1
    remove_p &= (top_p < 1.0).view(B, 1, 1)
    remove |= remove_p
    remove = remove.scatter(-1, order, remove)                                 # vocab order
    return scores.masked_fill(remove, float("-inf"))


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """Sampling distributions after temperature, top-k, top-p (transformers' warper order).

    logits: [B, n, V] raw logits, any float dtype (computed in float32)
    temperature: [B] float, 0 means greedy for that row
    top_k: [B] int, 0 disables
    top_p: [B] float, 1.0 disables
    filtered: False promises that no row uses top-k or top-p, skipping the vocabulary sort
    returns [B, n, V] float32 probabilities; greedy rows are the one-hot of the first argmax.
    """
    B, n, V = logits.shape
    scores = logits.to(torch.float32)                                          # [B, n, V]
    greedy = (temperature <= 0).view(B, 1, 1)
    t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)      # [B]
    scores = scores / t.view(B, 1, 1)
    if filtered:
        scores = _filter_top_k_top_p(scores, top_k, top_p)
    probs = scores.softmax(dim=-1)                                             # [B, n, V]
    top1 = logits.argmax(dim=-1, keepdim=True)                                 # [B, n, 1]
    one_hot = torch.zeros_like(probs).scatter_(-1, top1, 1.0)                  # [B, n, V]
    return torch.where(greedy, one_hot, probs)


_CDF_UNIT = 2.0 ** 40    # fixed-point scale of the integer CDF


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the token i with cdf[i-1] <= u * total < cdf[i].

    probs: [..., V] probabilities (non-negative; unnormalised weights work if they sum to
           less than 2**22 and are not tiny: each positive weight is rounded up to a multiple
           of 2**-40)
    u: [...] uniforms in [0, 1); float64 ones resolve probabilities far below 2**-24
    returns [...] int64 tokens; a token of weight 0 is never chosen (an all-zero row gives 0).

    The CDF is summed in int64 fixed point (2**-40 units, exact power-of-two scaling, positive
    weights rounded up so that each keeps a non-empty interval): exact, monotone and identical
    on every device, unlike a float cumsum whose top end falls short of 1 and whose parallel
    CUDA scan can give a zero-probability token a one-ulp interval.
    """
    p = probs if probs.dtype == torch.float64 else probs.to(torch.float32)
    cdf = (p * _CDF_UNIT).ceil_().to(torch.int64).cumsum_(dim=-1)            # [..., V]
    total = cdf[..., -1:]                                                      # [..., 1]
    x = (u.to(torch.float64).unsqueeze(-1) * total.to(torch.float64)).to(torch.int64)
    x = torch.minimum(x, total - 1)                                            # [..., 1] < total
    token = torch.searchsorted(cdf, x, right=True)                             # [..., 1]
    return token.squeeze(-1).clamp(max=p.shape[-1] - 1)


def gather_token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs: [B, k, V], tokens: [B, k] -> [B, k] probability of each token."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def count_accepted(accept: torch.Tensor) -> torch.Tensor:
    """accept: [B, k] bool per draft token -> [B] int64 length of the accepted prefix (0..k)."""
    return accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def accept_tokens(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                  u_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: tokens` under sampling (lossless).

    The target samples t_i from p_i at every position; draft tokens are kept while d_i == t_i,
    and next_token is t at the first mismatch (or the bonus t_k). The emitted tokens are exactly
    what the target alone would sample with the same uniforms, whatever the draft proposed.

    draft_tokens: [B, k]; target_probs: [B, k+1, V] warped; u_target: [B, k+1]
    returns accepted [B] in 0..k and next_token [B]
    """
    k = draft_tokens.shape[1]
    target_tokens = sample_from(target_probs, u_target)                       # [B, k+1]
    accepted = count_accepted(draft_tokens == target_tokens[:, :k])            # [B]
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)         # [B]
    return accepted, next_token


def rejection_test(p_draft: torch.Tensor, q_draft: torch.Tensor, u_accept: torch.Tensor
                   ) -> torch.Tensor:
    """Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); q_i(d_i) = 0 accepts.

    p_draft, q_draft, u_accept: [B, k] -> [B, k] bool. p >= q always accepts (u < 1).
    """
    return (q_draft <= 0) | (u_accept < p_draft / q_draft)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; where that is all zero (p == q) returns p.

    p, q: [..., V] -> [..., V] float32 (or float64)
    """
    r = (p - q).clamp(min=0)                                                   # [..., V]
    total = r.sum(dim=-1, keepdim=True)                                        # [..., 1]
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


def sample_correction(draft_probs: torch.Tensor, target_probs: torch.Tensor,
                      accepted: torch.Tensor, u_sample: torch.Tensor) -> torch.Tensor:
    """The token after the accepted prefix: from norm(max(0, p_a - q_a)) after a rejection at a,
    from p_k (bonus) when all k were accepted.

    draft_probs: [B, k, V] q; target_probs: [B, k+1, V] p; accepted: [B]; u_sample: [B, k+1]
    returns [B] int64
    """
    B, k, V = draft_probs.shape
    idx = accepted.view(B, 1, 1).expand(B, 1, V)                               # [B, 1, V]
    p_a = target_probs.gather(1, idx)                                          # [B, 1, V]
    if k == 0:
        q_a = torch.zeros_like(p_a)
    else:
        q_a = draft_probs.gather(1, idx.clamp(max=k - 1)).to(p_a.dtype)        # [B, 1, V]
        q_a = torch.where((accepted < k).view(B, 1, 1), q_a, 0.0)            # bonus: q = 0
    r = residual_probs(p_a.to(torch.float32), q_a.to(torch.float32))          # [B, 1, V]
    u = u_sample.gather(1, accepted[:, None])                                  # [B, 1]
    return sample_from(r, u).squeeze(1)


def accept_rejection(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance: logits`: modified rejection sampling; emitted tokens are distributed exactly
    as the target's sampling. With one-hot p and q it is greedy matching.

    draft_tokens: [B, k] sampled from draft_probs; draft_probs: [B, k, V] q (warped);
    target_probs: [B, k+1, V] p (warped); u_accept: [B, k]; u_sample: [B, k+1]
    returns accepted [B] in 0..k and next_token [B]
    """
    k = draft_tokens.shape[1]
    p_d = gather_token_probs(target_probs[:, :k], draft_tokens)                # [B, k]
    q_d = gather_token_probs(draft_probs, draft_tokens)                        # [B, k]
    accepted = count_accepted(rejection_test(p_d, q_d, u_accept))              # [B]
    next_token = sample_correction(draft_probs, target_probs, accepted, u_sample)
    return accepted, next_token
