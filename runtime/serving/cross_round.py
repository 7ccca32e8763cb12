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
from typing import NamedTuple

from runtime.control import commands, protocol
from runtime.speculation.retokenize import TextBridge, keep_length


class RoundOutcome(NamedTuple):
    """What a round brought, per slot, and what it cost (runtime.serving.scheduler)."""

    tokens: list[list[int]]
    accepted: list[int]
    overlapped: list[bool]
    cached: list[int]
    cost: float
    steps: int
    k: int  # proposals verified per slot (the most)


@dataclass
class DraftView:
    """What rank 0 knows of one sequence's draft: its committed history (its own ids) and
    the tokens whose KV its cache holds (the history but its last, then proposals)."""

    seq: object
    admission: int
    history: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)


class CrossRounds:
    def __init__(self, bridge: TextBridge, capacity: int, max_k: int):
        """capacity: positions of the draft's fixed tables; max_k: the most proposals the
        target verifies at once (speculation's max draft_len)."""
        self.bridge = bridge
        self.capacity = capacity
        self.max_k = max_k
        self.views: dict[int, DraftView] = {}

    def round(self, sched, slots: list[int], k: int) -> RoundOutcome:
        """One round of `slots` (sched: the Scheduler) drafting k tokens each (k 0: the
        target alone)."""
        start = sched.metrics.round_begins()
        seqs = [sched.running[s] for s in slots]
        proposals = self._propose(sched, slots, seqs, k) if k > 0 else [[] for _ in slots]
        proposals = [p[: self.max_k] for p in proposals]
        width = max(len(p) for p in proposals)
        command = commands.CrossVerifyCommand(slots, proposals, sched._grow(slots))
        results = sched.pool.command(command.to_msg(), sched.step_timeout_s)
        cost = sched.metrics.round_ends(start, results, width)
        replies = [commands.RoundReply.from_map(r) for r in results.values()]
        verdict = _leader(replies)
        reports = [r.cached for r in replies if r.cached]
        cached = [min(c) for c in zip(*reports)] if reports else [0] * len(slots)
        return RoundOutcome(
            verdict.tokens, verdict.accepted, [False] * len(slots), cached, cost, 1, width
        )

    def _propose(self, sched, slots: list[int], seqs: list, k: int) -> list[list[int]]:
        """The draft's k proposals per slot, mapped to target ids ([] for a slot that
        cannot draft)."""
        views = [self._view(slot, seq) for slot, seq in zip(slots, seqs)]
        histories = [self.bridge.draft_history(seq.tokens) for seq in seqs]
        rows = [i for i, h in enumerate(histories) if h and len(h) + k - 1 <= self.capacity]
        out = [[] for _ in slots]
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
        results = sched.pool.command(command.to_msg(), sched.step_timeout_s)
        drafts = _leader([commands.RoundReply.from_map(r) for r in results.values()]).tokens
        for i, row in zip(rows, drafts):
            view = views[i]
            view.history = histories[i]
            view.fed = histories[i] + row[: k - 1]
            out[i] = self.bridge.to_target(seqs[i].tokens, histories[i], row)
        return out

    def _view(self, slot: int, seq) -> DraftView:
        """The slot's DraftView, new when another sequence (or a readmission) holds it."""
        view = self.views.get(slot)
        if view is None or view.seq is not seq or view.admission != seq.admitted:
            view = self.views[slot] = DraftView(seq, seq.admitted)
        return view


def _leader(replies: list[commands.RoundReply]) -> commands.RoundReply:
    """The one reporting reply (the draft's or the target's leader) among a command's."""
    leaders = [r for r in replies if r.reports]
    if len(leaders) != 1:
        raise protocol.ProtocolError(f"a cross round got {len(leaders)} leader replies")
    return leaders[0]
