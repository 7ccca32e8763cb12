"""Adaptive draft length (`speculation.draft_len: auto`).

Each round the scheduler asks for k and reports back what happened. The controller keeps
- alpha: the per-token acceptance probability, estimated as accepted / reached over recent
  rounds (a draft token is "reached" when all tokens before it were accepted), and
- the round cost T(k) = t_verify + k * t_draft per batch-size bucket, fitted by least squares
  over recent (k, round seconds) observations,
and picks the k in 1..max_k that maximises expected tokens per second,
(1 - alpha^(k+1)) / (1 - alpha) / T(k). Until it has seen two different k it explores.
"""
from __future__ import annotations

from collections import deque

WINDOW = 64            # recent rounds kept per batch-size bucket for the cost fit
EXPLORE_EVERY = 16     # one round in this many tries a neighbour of the best k
DECAY = 0.98           # weight of the past in the acceptance estimate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round with k drafts at per-token acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DraftLenController:
    def __init__(self, fixed: int | None, max_k: int):
        self.fixed = fixed
        self.max_k = max_k
        self.accepted_w = 1.0       # prior: alpha = 0.5
        self.reached_w = 2.0
        self.costs: dict[int, deque] = {}
        self.rounds = 0
        self.last_k = fixed or min(4, max_k)

    @property
    def alpha(self) -> float:
        return self.accepted_w / self.reached_w

    def _bucket(self, batch: int) -> int:
        return max(1, batch).bit_length()

    def _fit(self, batch: int) -> tuple[float, float] | None:
        """(t_verify, t_draft) for this batch size, or None until two k values were seen."""
        obs = self.costs.get(self._bucket(batch))
        if not obs or len({k for k, _ in obs}) < 2:
            return None
        n = len(obs)
        mk = sum(k for k, _ in obs) / n
        mt = sum(t for _, t in obs) / n
        var = sum((k - mk) ** 2 for k, _ in obs)
        slope = max(0.0, sum((k - mk) * (t - mt) for k, t in obs) / var)
        return max(1e-9, mt - slope * mk), slope

    def choose(self, batch: int) -> int:
        if self.fixed is not None:
            return self.fixed
        self.rounds += 1
        fit = self._fit(batch)
        if fit is None:                          # explore: alternate low and high k
            self.last_k = 2 if self.rounds % 2 else min(self.max_k, 6)
            return self.last_k
        t_verify, t_draft = fit
        best = max(range(1, self.max_k + 1),
                   key=lambda k: expected_tokens(self.alpha, k) / (t_verify + k * t_draft))
        if self.rounds % EXPLORE_EVERY == 0:     # keep the cost fit honest around the best
            best = min(self.max_k, best + 1) if self.rounds % (2 * EXPLORE_EVERY) else \
                max(1, best - 1)
        self.last_k = best
        return best

    def observe(self, k: int, accepted: list[int], round_s: float) -> None:
        """One round: k drafts per sequence, accepted drafts per sequence, wall seconds."""
        if self.fixed is not None or not accepted:
            return
        reached = sum(min(a + 1, k) for a in accepted)    # drafts that were tested
        self.accepted_w = DECAY * self.accepted_w + sum(accepted)
        self.reached_w = DECAY * self.reached_w + reached
        obs = self.costs.setdefault(self._bucket(len(accepted)), deque(maxlen=WINDOW))
        obs.append((k, round_s))
