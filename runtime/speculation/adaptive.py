"""Adaptive draft length (`speculation.draft_len: auto`).

Each round the scheduler asks for k and reports back what happened. The controller keeps

- acceptance per draft position j = 1..max_k: decayed counts of how often draft token j was
  reached (tested: j <= k and every token before it accepted) and accepted. The conditional
  acceptance a_j = (accepted_j + PRIOR * alpha) / (reached_j + PRIOR) shrinks each position
  toward the pooled acceptance alpha (accepted / reached over all positions), so a position
  seen rarely or never falls back to alpha. A position's counts decay only in rounds that
  reach it, so positions tested only by exploration still build up evidence;
- the round cost T(k) per batch-size bucket: the median of the recent rounds run at that k
  when there are at least MIN_COST_OBS of them, otherwise t_verify + k * t_draft from a least
  squares line through those medians (when two k values have them; else through the
  bucket's recent (k, seconds) observations). Measured costs capture what a line cannot
  (verify shapes that change cost in steps, fixed per-round overhead); the line only fills
  in k values not measured lately, and one slow round does not bend it (through single
  observations, one slow first round at a short k flattened the line for WINDOW rounds, and
  every unmeasured k, k = 0 included, looked as costly as the longest),

and picks the k in 0..max_k that maximises expected tokens per second,
E[tokens | k] / T(k) with E[tokens | k] = 1 + sum_{j<=k} a_1 * ... * a_j (overlapped rounds
of sampled batches under `acceptance: logits` take no bonus token when all k are kept: less
a_1 * ... * a_k; greedy ones and `tokens` acceptance take it; their measured cost is what
overlapping makes of a round, so the choice needs no other model of it). k = 0 is a
target-only round: no draft, the target decodes up to TARGET_ONLY_STEPS tokens on one command
(so the control round trip is paid once for all of them), at 1 token per measured step; it
wins when the draft is rarely right, and every other exploration round then tries k = 1.
Until it has measured two k values (MIN_COST_OBS rounds each) it alternates a short and a
long k. Afterwards one round in
EXPLORE_EVERY runs a neighbour of the best k, alternately above and below, so the k values
around the choice stay measured; and, half-way between those, a round may run the most
promising k whose cost is only read off the line, when the line puts it within PLAUSIBLE of
the best rate, so a step the line cannot see (a cheaper k far from the current one) is found.
"""

from __future__ import annotations

from collections import deque
from statistics import median

TARGET_ONLY_STEPS = 16  # decode steps of one target-only (k = 0) round
WINDOW = 64  # recent rounds kept per batch-size bucket for the cost line
EXPLORE_EVERY = 16  # one round in this many tries a neighbour of the best k
DECAY = 0.98  # weight of the past in the pooled acceptance, per round
POS_DECAY = 0.99  # weight of the past in a position's counts, per round reaching it
PRIOR = 2.0  # pseudo-observations pulling a position's acceptance toward alpha
PER_K = 8  # recent round costs kept per (bucket, k)
MIN_COST_OBS = 3  # measured rounds at k needed to trust their median over the line
MAX_COST_AGE = 512  # rounds after which a measured cost no longer counts as recent
PLAUSIBLE = 0.8  # unmeasured k predicted within this share of the best get measured


def takes_bonus(greedy: bool, acceptance: str) -> bool:
    """Whether an overlapped round keeps the target's bonus token: its argmax (greedy) or its
    own sample (`tokens`: a draft token counts only when it equals the target's sample, so
    the target draws b without looking at w_1, and w_1 == b is a match like any other).
    `logits` acceptance of a sampled batch tests w_1 with its q: the target holds its logits
    (runtime.worker.overlap)."""
    return greedy or acceptance == "tokens"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round with k drafts at i.i.d. per-token acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_by_position(accept: list[float]) -> list[float]:
    """E[tokens | k] for k = 1..len(accept), given conditional acceptance per position."""
    expected, reach, total = [], 1.0, 1.0
    for a in accept:
        reach *= a
        total += reach
        expected.append(total)
    return expected


def _reach(accept: list[float], k: int) -> float:
    """Probability that all of k drafts are accepted (a_1 * ... * a_k)."""
    reach = 1.0
    for a in accept[:k]:
        reach *= a
    return reach


class DraftLenController:
    """Chooses the draft length per round; a fixed draft length bypasses it entirely."""

    def __init__(self, fixed: int | None, max_k: int, overlap: bool = False):
        self.fixed = fixed
        self.max_k = max_k
        self.overlap = overlap  # sampled batches: a wholly accepted window, no bonus
        self.accepted_w = 1.0  # pooled prior: alpha = 0.5
        self.reached_w = 2.0
        self.pos_accepted = [0.0] * max_k
        self.pos_reached = [0.0] * max_k
        self.costs: dict[int, deque] = {}
        self.costs_at: dict[tuple[int, int], deque] = {}
        self.rounds = 0
        self.last_k = fixed or min(4, max_k)

    @property
    def alpha(self) -> float:
        """Pooled per-token acceptance over all draft positions."""
        return self.accepted_w / self.reached_w

    def position_acceptance(self) -> list[float]:
        """Conditional acceptance a_j for j = 1..max_k, shrunk toward the pooled alpha."""
        alpha = self.alpha
        return [
            (acc + PRIOR * alpha) / (reached + PRIOR)
            for acc, reached in zip(self.pos_accepted, self.pos_reached)
        ]

    def _bucket(self, batch: int) -> int:
        return max(1, batch).bit_length()

    def _recent(self, bucket: int, k: int) -> list[float]:
        """Seconds of the recent rounds run at k in this bucket (k = 0: per step)."""
        return [t for r, t in self.costs_at.get((bucket, k), ()) if self.rounds - r <= MAX_COST_AGE]

    def _fit(self, bucket: int, medians: list[tuple[int, float]]) -> tuple[float, float] | None:
        """(t_verify, t_draft) for this bucket: least squares through `medians`, the (k,
        median seconds) of the k >= 1 measured lately (MIN_COST_OBS rounds each), when there
        are two, so that one slow round (a warm-up, a busy machine) moves no estimate; else
        through the recent rounds' (k, seconds) when they are 2 * MIN_COST_OBS of two k
        values or more; else None (the bucket is new: explore)."""
        obs = medians if len(medians) >= 2 else list(self.costs.get(bucket, ()))
        if len({k for k, _ in obs}) < 2 or (len(medians) < 2 and len(obs) < 2 * MIN_COST_OBS):
            return None
        n = len(obs)
        mk = sum(k for k, _ in obs) / n
        mt = sum(t for _, t in obs) / n
        var = sum((k - mk) ** 2 for k, _ in obs)
        slope = max(0.0, sum((k - mk) * (t - mt) for k, t in obs) / var)
        return max(1e-9, mt - slope * mk), slope

    def round_costs(self, batch: int) -> tuple[list[float], list[bool]] | None:
        """Estimated seconds per round for k = 0..max_k (k = 0: per target-only step) and
        whether each was measured (rather than read off the line: a target-only step is
        taken to cost the line's intercept, one verify of the pending token with its
        control round trip, until measured), or None while the bucket is new (_fit)."""
        bucket = self._bucket(batch)
        recent = [self._recent(bucket, k) for k in range(0, self.max_k + 1)]
        measured = [len(t) >= MIN_COST_OBS for t in recent]
        medians = {k: median(t) for k, (t, m) in enumerate(zip(recent, measured)) if m}
        fit = self._fit(bucket, [(k, t) for k, t in medians.items() if k > 0])
        if fit is None:
            return None
        t_verify, t_draft = fit
        return [medians.get(k, t_verify + k * t_draft) for k in range(0, self.max_k + 1)], measured

    def choose(self, batch: int, bonus: bool = False) -> int:
        """Draft length for the next round of `batch` sequences (bonus: an overlapped round
        takes the target's bonus token: takes_bonus)."""
        if self.fixed is not None:
            return self.fixed
        self.rounds += 1
        estimate = self.round_costs(batch)
        if estimate is None:  # new bucket: alternate a low and a high k
            self.last_k = 2 if self.rounds % 2 else min(self.max_k, 6)
            return self.last_k
        costs, measured = estimate
        accept = self.position_acceptance()
        expected = [1.0] + expected_tokens_by_position(accept)
        if self.overlap and not bonus:  # no bonus when all k are kept: the window is held
            expected = [1.0] + [e - _reach(accept, k) for k, e in enumerate(expected[1:], 1)]
        rates = [e / t for e, t in zip(expected, costs)]
        self.last_k = self._explore(rates, measured)
        return self.last_k

    def _explore(self, rates: list[float], measured: list[bool]) -> int:
        """The k with the best rate, or on exploration rounds a k worth measuring
        (rates[k] for k = 0..max_k)."""
        best = rates.index(max(rates))
        if self.rounds % EXPLORE_EVERY == 0:  # keep the neighbours' estimates fresh
            return (
                min(self.max_k, best + 1) if self.rounds % (2 * EXPLORE_EVERY) else max(0, best - 1)
            )
        if self.rounds % EXPLORE_EVERY == EXPLORE_EVERY // 2:
            # the line may misjudge k values far from those run lately: measure the most
            # promising unmeasured one, if the line says it is close to the best
            rate, k = max(
                ((r, k) for k, (r, m) in enumerate(zip(rates, measured)) if not m),
                default=(0.0, best),
            )
            if rate >= PLAUSIBLE * rates[best]:
                return k
        return best

    def observe(self, k: int, accepted: list[int], round_s: float, steps: int = 1) -> None:
        """One round: k drafts per sequence, accepted drafts per sequence, wall seconds; a
        target-only round (k = 0) of `steps` decode steps is kept as seconds per step."""
        if self.fixed is not None or not accepted:
            return
        bucket = self._bucket(len(accepted))
        if k == 0:
            self.costs_at.setdefault((bucket, 0), deque(maxlen=PER_K)).append(
                (self.rounds, round_s / steps)
            )
            return
        self._observe_acceptance(k, accepted)
        self.costs.setdefault(bucket, deque(maxlen=WINDOW)).append((k, round_s))
        self.costs_at.setdefault((bucket, k), deque(maxlen=PER_K)).append((self.rounds, round_s))

    def _observe_acceptance(self, k: int, accepted: list[int]) -> None:
        """Update the pooled and per-position counts with one round's outcomes."""
        reached = [min(a + 1, k) for a in accepted]  # drafts that were tested
        self.accepted_w = DECAY * self.accepted_w + sum(accepted)
        self.reached_w = DECAY * self.reached_w + sum(reached)
        for j in range(min(k, self.max_k)):
            n_reached = sum(1 for r in reached if r > j)
            if n_reached:
                self.pos_accepted[j] = POS_DECAY * self.pos_accepted[j] + sum(
                    1 for a in accepted if a > j
                )
                self.pos_reached[j] = POS_DECAY * self.pos_reached[j] + n_reached
