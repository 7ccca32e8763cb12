"""Rounds with a draft that speaks another tokenizer, on rank 0 (runtime.config.vocab:
cross_tokenizer; docs/configuration.md, "A draft with another tokenizer").

One round is two commands instead of one (runtime.worker.cross):
1. `draft_cross`: each slot's committed target tokens, as text, re-tokenised for the draft
   (TextBridge.draft_history); the draft rolls back to the longest prefix of what its cache
   holds that the new history keeps, feeds the rest, and proposes k of its own ids;
2. `verify_cross`: rank 0 maps the proposals to the target's ids (TextBridge.to_target),
   at most max draft_len per slot, and the target verifies them with `tokens` acceptance
   and commits: what is emitted is the target's own choice at every position.
A slot whose draft history would not fit the draft's cache (its own fixed tables of the
config's kv_seq_len positions) proposes nothing (the target alone takes its next token).
Drafting ahead and overlap are off for such pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.control import commands
from runtime.control.pool import WorkerPool
from runtime.serving.executor import Executor, leader, round_replies
from runtime.serving.metrics import ServingMetrics
from runtime.serving.plan import RoundPlan, StepReplies
from runtime.serving.sequence import Sequence
from runtime.speculation.retokenize import TextBridge, keep_length


@dataclass
class DraftView:
    """What rank 0 knows of one sequence's draft: its committed history (its own ids) and
    the tokens whose KV its cache holds (the history but its last, then proposals)."""

    seq: Sequence
    admission: int
    history: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)


class CrossExecutor(Executor):
    """An Executor whose rounds are two commands: the draft proposes in its own ids, the
    target verifies them mapped to its own."""

    def __init__(
        self,
        pool: WorkerPool,
        step_timeout_s: float,
        metrics: ServingMetrics,
        bridge: TextBridge,
        capacity: int,
        max_k: int,
    ):
        """capacity: positions of the draft's fixed tables; max_k: the most proposals the
        target verifies at once (speculation's max draft_len)."""
        super().__init__(pool, step_timeout_s, metrics)
        self.bridge = bridge
        self.capacity = capacity
        self.max_k = max_k
        self.views: dict[int, DraftView] = {}

    def _round(self, plan: RoundPlan, replies: StepReplies) -> None:
        """One round of the plan's rows drafting k tokens each (k 0: the target alone); a
        row joining the round from this step's prefill drafts after its first token."""
        start = self.metrics.round_begins()
        slots, seqs, k = plan.slots, plan.seqs, plan.k
        committed = [s.tokens for s in seqs]
        proposals = self._propose(slots, seqs, committed, k) if k > 0 else [[] for _ in slots]
        proposals = [p[: self.max_k] for p in proposals]
        width = max(len(p) for p in proposals)
        command = commands.CrossVerifyCommand(slots, proposals, plan.growth)
        self._took_round(replies, start, self.send(command), width, len(slots))

    def _propose(
        self, slots: list[int], seqs: list[Sequence], committed: list[list[int]], k: int
    ) -> list[list[int]]:
        """The draft's k proposals per slot after its `committed` tokens, mapped to target
        ids ([] for a slot that cannot draft)."""
        views = [self._view(slot, seq) for slot, seq in zip(slots, seqs)]
        histories = [self.bridge.draft_history(tokens) for tokens in committed]
        rows = [i for i, h in enumerate(histories) if h and len(h) + k - 1 <= self.capacity]
        out: list[list[int]] = [[] for _ in slots]
        if not rows:
            return out
        keep = [keep_length(histories[i], views[i].fed) if views[i].history else 0 for i in rows]
        command = commands.CrossDraftCommand(
            [slots[i] for i in rows],
            k,
            keep,
            [histories[i][n:] for i, n in zip(rows, keep)],
            [seqs[i].worker_params() for i in rows],
        )
        drafts = leader(round_replies(self.send(command))).tokens
        for i, row in zip(rows, drafts):
            view = views[i]
            view.history = histories[i]
            view.fed = histories[i] + row[: k - 1]
            out[i] = self.bridge.to_target(committed[i], histories[i], row)
        return out

    def _view(self, slot: int, seq: Sequence) -> DraftView:
        """The slot's DraftView, new when another sequence (or a readmission) holds it."""
        view = self.views.get(slot)
        if view is None or view.seq is not seq or view.admission != seq.admitted:
            view = self.views[slot] = DraftView(seq, seq.admitted)
        return view
