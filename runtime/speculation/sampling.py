"""Sampling distributions and exact sampling from them (the core of speculative sampling).

- warp_probs: processed logits -> the request's sampling distribution (temperature, min-p,
  top-k, top-p; top-k and top-p exactly as transformers' warpers; temperature 0 = greedy
  one-hot).
- sample_from: inverse-CDF sampling driven by given uniforms (see runtime/speculation/rng.py).

The acceptance rules built on these are in runtime/speculation/acceptance.py.

Shapes: B requests, k draft tokens, V vocabulary. Everything is batched tensor code without host
synchronisation, so it runs unchanged on CPU and CUDA. Given the same uniforms the results do not
depend on the batch composition.
"""

from __future__ import annotations

import torch

from runtime.speculation.processors import min_p_filter


def _filter_top_k_top_p(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
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
    sorted_scores, order = sorted_scores.flip(-1), order.flip(-1)  # [B, n, V]
    k = torch.where(top_k > 0, top_k, V).clamp(1, V).to(torch.int64)  # [B]
    kth = sorted_scores.gather(-1, (V - k).view(B, 1, 1).expand(B, n, 1))  # [B, n, 1]
    remove = sorted_scores < kth  # [B, n, V]
    sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [B, n, V]
    # transformers compares with the Python float 1 - top_p, rounded to float32 by the kernel
    threshold = (1.0 - top_p.to(torch.float64)).to(torch.float32).view(B, 1, 1)
    remove_p = cum <= threshold  # [B, n, V]
    remove_p[..., -1] = False  # min_tokens_to_keep=1
    remove_p &= (top_p < 1.0).view(B, 1, 1)
    remove |= remove_p
    remove = remove.scatter(-1, order, remove)  # vocab order
    return scores.masked_fill(remove, float("-inf"))


def warp_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filtered: bool = True,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampling distributions after temperature, min-p, top-k, top-p (vLLM's order; without
    min-p transformers' warpers'). Processed logits (runtime.speculation.processors) come in.

    logits: [B, n, V] raw logits, any float dtype (computed in float32)
    temperature: [B] float, 0 means greedy for that row
    top_k: [B] int, 0 disables
    top_p: [B] float, 1.0 disables
    filtered: False promises that no row uses top-k or top-p, skipping the vocabulary sort
    min_p: [B] float, 0 disables; None: no row uses it
    returns [B, n, V] float32 probabilities; greedy rows are the one-hot of the first argmax.
    """
    B, n, V = logits.shape
    scores = logits.to(torch.float32)  # [B, n, V]
    greedy = (temperature <= 0).view(B, 1, 1)
    t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)  # [B]
    scores = scores / t.view(B, 1, 1)
    if min_p is not None:
        scores = min_p_filter(scores, min_p)
    if filtered:
        scores = _filter_top_k_top_p(scores, top_k, top_p)
    probs = scores.softmax(dim=-1)  # [B, n, V]
    top1 = logits.argmax(dim=-1, keepdim=True)  # [B, n, 1]
    one_hot = torch.zeros_like(probs).scatter_(-1, top1, 1.0)  # [B, n, V]
    return torch.where(greedy, one_hot, probs)


_CDF_UNIT = 2.0**40  # fixed-point scale of the integer CDF


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
    cdf = (p * _CDF_UNIT).ceil_().to(torch.int64).cumsum_(dim=-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    x = (u.to(torch.float64).unsqueeze(-1) * total.to(torch.float64)).to(torch.int64)
    x = torch.minimum(x, total - 1)  # [..., 1] < total
    token = torch.searchsorted(cdf, x, right=True)  # [..., 1]
    return token.squeeze(-1).clamp(max=p.shape[-1] - 1)
