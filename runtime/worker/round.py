"""One speculation round on this rank, top to bottom (cf. gpt-fast's `speculative_decode`).

Every worker of the round runs the same function; what a rank does at each step depends on
the shards it hosts (draft, target or both). Tensors stay on the device and cross between
the draft and the target groups over the bridge group (NCCL on GPU, gloo on CPU):

    draft proposes k tokens          tokens [B, k], q [B, k, V] for `logits` acceptance
      -> bridge -> target              (draft leader -> every worker)
    target verifies and accepts      one forward over pending + k tokens: accepted [B], next [B]
      -> bridge -> draft               (target leader -> every worker)
    both commit                      caches roll back to the accepted length (length updates)

The worker process only dispatches commands here (runtime.worker.dispatch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from parallel.transfer import bridge_broadcast
from runtime.control.commands import TARGET_LEADER, WORKER, RoundReply, Sampling
from runtime.models.runners.hostcopy import to_device
from runtime.speculation.adaptive import takes_bonus
from runtime.worker import overlap
from runtime.worker.draft_shard import DraftShard
from runtime.worker.stepclock import StepClock
from runtime.worker.target_shard import TargetShard

DECODE_AHEAD_STEPS = 1  # target-only steps queued ahead: one outlasts a control round trip


@dataclass
class RoundParts:
    """What a round touches on this rank."""

    draft: DraftShard | None  # this rank's draft shard, if it hosts one
    target: TargetShard | None  # this rank's target shard, if it hosts one
    bridge: torch.distributed.ProcessGroup | None  # every worker (None: one worker)
    draft_leader: int  # global rank that sends the draft tokens
    target_leader: int  # global rank that sends the verdict and reports it
    rank: int
    device: torch.device
    acceptance: str  # tokens | logits
    profile: bool = False  # time each phase (TANDEM_PROFILE=1)
    overlap: bool = False  # draft the next window while the target verifies

    @property
    def reports(self) -> bool:
        return self.rank == self.target_leader

    @property
    def shard(self) -> DraftShard | TargetShard:
        """The target's shard here, else the draft's (every worker hosts one)."""
        shard = self.target or self.draft
        if shard is None:
            raise RuntimeError(f"rank {self.rank} hosts neither the draft nor the target")
        return shard


@dataclass(frozen=True)
class NextWork:
    """The round after this one, as the orchestrator announced it (its next_k): what to
    start on once this round's result has left (see work_ahead)."""

    slots: list[int]
    k: int  # 0: a target-only round


def speculate(parts: RoundParts, slots: list[int], k: int) -> RoundReply:
    """Draft k tokens, move them (and q for `logits` acceptance) to the target, verify, move
    the verdict back, roll both caches to the accepted length. The result: the target
    leader's committed tokens per slot ([accepted drafts] + [correction or bonus token])."""
    start, clock = time.perf_counter(), StepClock(parts.device, enabled=parts.profile)
    batch, dev = len(slots), parts.device
    need_q = parts.acceptance == "logits" and not parts.shard.greedy(slots)
    # 1. draft: k proposals per slot (drafted ahead while the last verdict travelled, or now)
    draft_tokens = torch.zeros(batch, k, dtype=torch.long, device=dev)  # [B, k]
    draft_probs = None  # [B, k, V] q
    if parts.draft is not None:
        ahead = parts.draft.take_ahead(slots, k)
        draft_tokens, draft_probs = ahead or parts.draft.propose(slots, k)
    clock.lap("draft_s")
    # 2. draft -> target
    bridge_broadcast(draft_tokens, parts.draft_leader, parts.bridge)
    clock.lap("draft_tokens_transfer_s")
    if need_q:
        if draft_probs is None:
            draft_probs = torch.zeros(batch, k, _q_width(parts), device=dev)
        bridge_broadcast(draft_probs, parts.draft_leader, parts.bridge)
    clock.lap("draft_probs_transfer_s")
    # 3. target: one forward over pending + k drafts; accept a prefix, add one token of its own
    verdict = torch.zeros(batch, 2, dtype=torch.long, device=dev)  # [B, 2]
    if parts.target is not None:
        verdict = torch.stack(
            parts.target.verify(slots, draft_tokens, draft_probs if need_q else None), dim=1
        )
    clock.lap("verify_s")
    # 4. target -> draft; 5. both commit
    drafts, accepted, next_tokens = _verdict_to_all(parts, draft_tokens, verdict, clock)
    if parts.draft is not None:
        parts.draft.commit(slots, drafts, accepted, next_tokens)
    if parts.target is not None:
        parts.target.commit(slots, accepted, next_tokens)
    tokens = [d[:a] + [n] for d, a, n in zip(drafts, accepted, next_tokens)]
    remember(parts, slots, tokens)
    return _result(parts, slots, start, clock, tokens, accepted)


def speculate_overlapped(parts: RoundParts, slots: list[int], k: int, next_k: int) -> RoundReply:
    """A round of overlapped speculation (runtime.worker.overlap): the draft's ranks and the
    target's are disjoint, and while the target verifies this window the draft drafts the
    next one as if this one will be kept. Greedy or `tokens` acceptance: the target takes its
    bonus token, and a slot keeps its next window when all k were accepted and the window's
    first token is that bonus. Sampled under `logits`: a slot whose window is wholly accepted
    commits its k drafts without a bonus token (next_k > 0): its next window is ready, and the
    target's held logits verify its first token next round."""
    start, clock = time.perf_counter(), StepClock(parts.device, enabled=parts.profile)
    batch, dev, draft, target = len(slots), parts.device, parts.draft, parts.target
    greedy = parts.shard.greedy(slots)
    bonus = takes_bonus(greedy, parts.acceptance)  # else held logits
    need_q = parts.acceptance == "logits" and not greedy
    # 1. draft: this window (drafted during the last round where the slot was kept)
    sent = torch.zeros(batch, k + 1, dtype=torch.long, device=dev)  # [B, k] drafts, [B] ready
    draft_probs = None  # [B, k, V] q
    if draft is not None:
        drafted, draft_probs, had_window = overlap.take_drafts(draft, slots, k)
        sent = torch.cat([drafted, to_device([[int(r)] for r in had_window], torch.long, dev)], 1)
    clock.lap("draft_s")
    # 2. draft -> target
    bridge_broadcast(sent, parts.draft_leader, parts.bridge)
    draft_tokens, ready = sent[:, :k], sent[:, k]  # [B, k], [B]
    if need_q:
        if draft_probs is None:
            draft_probs = torch.zeros(batch, k, _q_width(parts), device=dev)
        bridge_broadcast(draft_probs, parts.draft_leader, parts.bridge)
    clock.lap("draft_transfer_s")
    # 3. at once: the target verifies, the draft drafts the next window
    verdict = torch.zeros(batch, 2, dtype=torch.long, device=dev)  # [B, 2]
    window = last_logits = None
    if draft is not None and next_k > 0:
        window = draft.draft_window(
            slots, draft_tokens, draft_probs, overlap.window_len(next_k, bonus)
        )
    if target is not None:
        accepted_t, next_t, last_logits = target.verify_with_last(
            slots, draft_tokens, draft_probs if need_q else None
        )
        verdict = torch.stack([accepted_t, next_t], dim=1)
    clock.lap("verify_or_next_window_s")
    # 4. target -> draft; 5. both commit: kept slots keep the next window (draft), held ones
    # the target's last logits
    drafts, accepted, next_tokens = _verdict_to_all(parts, draft_tokens, verdict, clock)
    held = overlap.held_rows(accepted, k, next_k, bonus)
    if draft is not None:
        overlap.commit_draft(draft, slots, drafts, accepted, next_tokens, held, window, bonus)
    if target is not None:
        assert last_logits is not None  # the target verified above
        target.commit_held(slots, accepted, next_tokens, held, last_logits)
    tokens = [
        d[:a] if hold else d[:a] + [n] for d, a, n, hold in zip(drafts, accepted, next_tokens, held)
    ]
    remember(parts, slots, tokens)
    # per slot: was its window drafted during the last verify
    return _result(parts, slots, start, clock, tokens, accepted, [bool(r) for r in ready.tolist()])


def decode_target_only(parts: RoundParts, slots: list[int], steps: int) -> RoundReply:
    """A round without a draft (draft_len auto, k = 0): the target decodes `steps` tokens
    per slot, exactly those a round that rejected every draft would take, then they move
    to the draft, which feeds them to its cache with its next proposal."""
    start, clock = time.perf_counter(), StepClock(parts.device, enabled=parts.profile)
    tokens = torch.zeros(len(slots), steps, dtype=torch.long, device=parts.device)
    if parts.target is not None:
        tokens = parts.target.decode(slots, steps)  # [B, steps]
    clock.lap("decode_s")
    bridge_broadcast(tokens, parts.target_leader, parts.bridge)
    rows = tokens.tolist()  # the one sync
    clock.lap("tokens_transfer_s")
    for shard in (parts.draft, parts.target):
        if shard is not None:
            shard.append_decoded(slots, rows)
    remember(parts, slots, rows)
    return _result(parts, slots, start, clock, rows, [0] * len(slots))


def prefill(
    parts: RoundParts,
    slots: list[int],
    prompts: list[list[int]],
    params: list[Sampling],
    cached: list[int],
    tables: list[list[int]],
    final: list[bool],
) -> RoundReply:
    """Start or go on with these sequences' prompts (each slot's tokens from position
    cached[i] on) on both models: where they are a chunk of the prompt (not `final`) both
    cache all the tokens but the last; where they end it both cache all of them, the target
    picking the first output token (TargetShard.prefill_first), which moves to the draft;
    both commit it as a target-only round would (it alone pending). The reply's tokens:
    [first] per final slot, [] per chunk."""
    start, clock = time.perf_counter(), StepClock(parts.device, enabled=parts.profile)
    ends = [i for i, f in enumerate(final) if f]
    chunks = [i for i, f in enumerate(final) if not f]
    first = torch.zeros(len(ends), 1, dtype=torch.long, device=parts.device)  # [F, 1]
    draft = parts.draft if parts.draft is not None and not parts.draft.cross else None
    columns = (slots, prompts, params, cached, tables)
    if draft is not None:  # (a draft with another tokenizer starts at its first round)
        if chunks:
            draft.prefill(*_rows(chunks, *columns))
        if ends:
            draft.prefill(*_rows(ends, *columns), through=True)
    if parts.target is not None:
        if chunks:
            parts.target.prefill(*_rows(chunks, *columns))
        if ends:
            first = parts.target.prefill_first(*_rows(ends, *columns))
    clock.lap("prefill_s")
    rows: list[list[int]] = []
    if ends:
        bridge_broadcast(first, parts.target_leader, parts.bridge)
        rows = first.tolist()  # the one sync
        for shard in (draft, parts.target):
            if shard is not None:
                shard.append_decoded([slots[i] for i in ends], rows)
        remember(parts, [slots[i] for i in ends], rows)
    clock.lap("first_token_transfer_s")
    tokens: list[list[int]] = [[] for _ in slots]
    logprobs: list[list[list[float]]] = []
    firsts = [] if parts.target is None else parts.target.take_logprobs([1] * len(ends))
    if firsts:
        logprobs = [[] for _ in slots]
    for n, (i, row) in enumerate(zip(ends, rows)):
        tokens[i] = row
        if firsts:
            logprobs[i] = firsts[n]
    reply = _result(parts, slots, start, clock, tokens, [0] * len(slots), logprobs=logprobs or None)
    if parts.target is not None:
        scored = parts.target.take_prompt_logprobs(slots)
        if scored and parts.reports:
            reply = replace(reply, prompt_logprobs=scored)
    return reply


def remember(parts: RoundParts, slots: list[int], tokens: list[list[int]]) -> None:
    """The committed tokens join both shards' penalty histories (runtime.worker.history) and
    grammars (runtime.speculation.grammar.book)."""
    for shard in (parts.draft, parts.target):
        if shard is not None:
            shard.history.add(slots, tokens)
            shard.grammars.commit(slots, tokens)


def _q_width(parts: RoundParts) -> int:
    """The width of the draft's q on the bridge: the target's vocab_size (a draft padded
    differently widens its q to it: runtime.speculation.vocab)."""
    if parts.target is not None:
        return parts.target.model.vocab_size
    shard = parts.shard
    assert isinstance(shard, DraftShard)  # no target here: the draft's
    return shard.q_width


def _rows(
    index: list[int],
    slots: list[int],
    prompts: list[list[int]],
    params: list[Sampling],
    cached: list[int],
    tables: list[list[int]],
) -> tuple[
    list[int], list[list[int]], list[Sampling] | None, list[int] | None, list[list[int]] | None
]:
    """Those rows of a prefill's columns (an empty column stays None: the shard's default)."""
    return (
        [slots[i] for i in index],
        [prompts[i] for i in index],
        [params[i] for i in index] if params else None,
        [cached[i] for i in index] if cached else None,
        [tables[i] for i in index] if tables else None,
    )


def _verdict_to_all(
    parts: RoundParts, draft_tokens: torch.Tensor, verdict: torch.Tensor, clock: StepClock
) -> tuple[list[list[int]], list[int], list[int]]:
    """The target leader's verdict [B, 2] (accepted, next token) to every worker, then the
    round's one host sync: (drafts, accepted, next tokens) per slot on the host."""
    bridge_broadcast(verdict, parts.target_leader, parts.bridge)
    clock.lap("verdict_transfer_s")
    k = draft_tokens.shape[1]
    rows = torch.cat([draft_tokens, verdict], dim=1).tolist()  # [B, k+2]
    return ([row[:k] for row in rows], [row[k] for row in rows], [row[k + 1] for row in rows])


def _result(
    parts: RoundParts,
    slots: list[int],
    start: float,
    clock: StepClock,
    tokens: list[list[int]],
    accepted: list[int],
    overlapped: list[bool] | None = None,
    logprobs: list[list[list[float]]] | None = None,
) -> RoundReply:
    """The worker's reply: its own time (and phases when profiling); the committed tokens,
    accepted counts (and overlapped flags), logprobs of rows that ask for them, grammars that
    failed, from the target leader only."""
    timing = clock.laps if parts.profile else {}
    if logprobs is None:  # the target's records of the committed tokens
        lengths = [len(t) for t in tokens]
        logprobs = [] if parts.target is None else parts.target.take_logprobs(lengths)
    worker_s = time.perf_counter() - start
    if not parts.reports:
        return RoundReply(WORKER, worker_s, timing)
    failures = None if parts.target is None else parts.target.grammars.failures(slots)
    return RoundReply(
        TARGET_LEADER,
        worker_s,
        timing,
        tokens,
        accepted,
        overlapped or [],
        logprobs=logprobs or None,
        grammar_failures=failures,
    )


def drop_stale_ahead(parts: RoundParts, k: int | None) -> None:
    """Work done ahead is kept only by the round it was done for: drafts by a drafting round,
    decode steps by a target-only round (each shard then checks the slots); anything else
    (a prefill, a release, the other kind of round) drops it. Next windows of overlapped
    rounds are per slot and outlive prefills of other slots, not a target-only round."""
    for shard, keep in ((parts.draft, k is not None and k > 0), (parts.target, k == 0)):
        if shard is not None and not keep:
            shard.drop_ahead()
    if k == 0 and parts.draft is not None:
        parts.draft.drop_windows()


def work_ahead(parts: RoundParts, nxt: NextWork) -> Exception | None:
    """After a round's result is sent: queue the next round's first work on the device, so
    it runs while the orchestrator decides and its next command travels: the draft's
    proposals when the next round drafts, else the target's first DECODE_AHEAD_STEPS of a
    target-only round. A failure drops the work (the next round works on command) and is
    returned for the log."""
    draft, target = parts.draft, parts.target
    try:
        if nxt.k > 0 and draft is not None:  # slots with a next window have their drafts
            slots = [s for s in nxt.slots if s not in draft.windows]
            if slots:
                draft.propose_ahead(slots, nxt.k)
        elif nxt.k == 0 and target is not None:
            target.decode_ahead(nxt.slots, DECODE_AHEAD_STEPS)
    except Exception as exc:  # noqa: BLE001 - logged by the caller, the work dropped
        shard = draft if nxt.k > 0 else target
        if shard is not None:
            shard.drop_ahead()
        return exc
    return None
