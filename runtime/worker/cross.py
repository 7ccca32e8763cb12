"""A round with a draft that speaks another tokenizer, on this rank: two commands instead of
one round (runtime.serving.cross_round holds the text mapping on rank 0).

    draft_cross    the draft re-syncs each slot to the committed text (a rollback to the
                   positions it keeps, then the new tokens fed) and proposes k of its ids;
                   the draft leader reports them to rank 0
    verify_cross   the target verifies the proposals rank 0 re-tokenised for it (`tokens`
                   acceptance: its own choice at each position), the verdict goes to every
                   worker over the bridge (as in runtime.worker.round), the target commits

The draft never reads the target's ids, nor the target the draft's: the two share no block
tables (the draft keeps its fixed ones) and no bridge transfer of proposals.
"""

from __future__ import annotations

import time

import torch

from parallel.transfer import bridge_broadcast
from runtime.control.commands import (
    DRAFT_LEADER,
    TARGET_LEADER,
    WORKER,
    CrossDraftCommand,
    CrossVerifyCommand,
    RoundReply,
)
from runtime.models.runners.hostcopy import to_device
from runtime.worker.round import RoundParts, remember


def draft_cross(parts: RoundParts, cmd: CrossDraftCommand) -> RoundReply:
    """Re-sync the draft's slots and propose cmd.k tokens each; the draft leader reports
    them (its tokens per slot; accepted counts 0)."""
    start, rows = time.perf_counter(), []
    if parts.draft is not None:
        parts.draft.resync(cmd.slots, cmd.keep, cmd.tokens, cmd.params)
        tokens, _ = parts.draft.propose(cmd.slots, cmd.k)  # [B, k]
        rows = tokens.tolist()
    worker_s = time.perf_counter() - start
    if parts.rank != parts.draft_leader:
        return RoundReply(WORKER, worker_s)
    return RoundReply(DRAFT_LEADER, worker_s, {}, rows, [0] * len(rows))


def verify_cross(parts: RoundParts, cmd: CrossVerifyCommand) -> RoundReply:
    """The target verifies cmd.proposals and commits; the target leader reports the
    committed tokens per slot ([accepted proposals] + [its own next token])."""
    start, batch, dev = time.perf_counter(), len(cmd.slots), parts.device
    verdict = torch.zeros(batch, 2, dtype=torch.long, device=dev)  # [B, 2]
    if parts.target is not None:
        parts.target.grow(cmd.slots, cmd.tables)
        verdict = _verify_ragged(parts.target, cmd.slots, cmd.proposals)
    bridge_broadcast(verdict, parts.target_leader, parts.bridge)
    accepted, next_tokens = (list(column) for column in zip(*verdict.tolist()))
    tokens = [p[:a] + [n] for p, a, n in zip(cmd.proposals, accepted, next_tokens)]
    logprobs: list[list[list[float]]] = []
    if parts.target is not None:
        parts.target.commit(cmd.slots, accepted, next_tokens)
        remember(parts, cmd.slots, tokens)
        logprobs = parts.target.take_logprobs([len(t) for t in tokens])
    worker_s = time.perf_counter() - start
    if not parts.reports:
        return RoundReply(WORKER, worker_s)
    return RoundReply(TARGET_LEADER, worker_s, {}, tokens, accepted, logprobs=logprobs or None)


def _verify_ragged(target, slots: list[int], proposals: list[list[int]]) -> torch.Tensor:
    """The verdict [B, 2] (accepted, next token) of proposals of any lengths L_i, padded
    with id 0 to the longest. `tokens` acceptance makes the target's choice t_j at each
    position independent of the proposal there, so a row that accepts past its L_i matched
    its padding at L_i: t_{L_i} is that pad, and the row keeps L_i proposals and takes it."""
    dev, width = target.device, max((len(p) for p in proposals), default=0)
    padded = to_device([p + [0] * (width - len(p)) for p in proposals], torch.long, dev)
    padded = padded.reshape(len(slots), width)  # [B, k]
    accepted, next_token = target.verify(slots, padded)  # [B], [B]
    lengths = to_device([len(p) for p in proposals], torch.long, dev)  # [B]
    past = accepted > lengths
    pad = torch.cat([padded, torch.zeros_like(lengths)[:, None]], 1)  # [B, k+1]
    next_token = torch.where(past, pad.gather(1, lengths[:, None])[:, 0], next_token)
    return torch.stack([torch.minimum(accepted, lengths), next_token], dim=1)
