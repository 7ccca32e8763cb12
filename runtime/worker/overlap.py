"""Overlapped speculation: on its own devices the draft drafts the next window while the target
verifies this one (speculation.overlap; PEARL, Liu et al., ICLR 2025, post-verify).

Per slot, with N tokens committed when round r begins and its window d_1..d_k:

- draft: after sending d_1..d_k it goes on as if the target will keep them all: it decodes d_k
  and samples w_1 (its guess of the token at index N+k), then w_2, ...: the next window,
  drafted while the target verifies.
- target, greedy batches and sampled ones under `acceptance: tokens` (takes_bonus in
  runtime.speculation.adaptive): one forward as always, bonus token b (its argmax, or its own
  sample) included. A slot whose k drafts were all accepted and whose w_1 equals b keeps
  w_2..w_{m+1} as its next window (m = the next round's k; the draft drafted m + 1): a
  rejected w_1 costs no forward, the draft learns it with the verdict and drafts afresh
  from b.
- target, sampled batches under `acceptance: logits`: when it accepts all k and a next window
  was announced (the round's next_k > 0), it takes no bonus token: the slot commits
  d_1..d_k and the target holds its logits at the last position (the distribution of the
  token at index N+k). Next round its verify runs over w_1..w_m alone, and the held logits
  verify w_1 with the draft's q (the modified rejection rule needs q of the token it tests,
  so the target cannot decide before it sees w_1).
- draft, on the verdict: a slot kept keeps its next window; a slot rejected inside window r
  drops it (its KV rolls back by a length update) and drafts again from the correction.

Every committed token is still the target's choice (greedy), or passes the modified rejection
rule with the draft's q (sampled, `logits`), or equals the target's own sample (`tokens`).
Exactness never depends on timing: a window is a proposal like any other, and a draft that
lost one (a cache full, a batch that changed) drafts afresh from the same committed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from runtime.models.runners.hostcopy import to_device
from runtime.worker.shards import DraftShard, SlotState, TargetShard


@dataclass
class DraftWindow:
    """One slot's next window, drafted while the target verified the last one."""
    tokens: torch.Tensor                # [m] on the device
    probs: torch.Tensor | None          # [m, V] q when the batch sampled, else None
    fallback: SlotState                 # the slot's state without it (re-feeds the last token)


def held_rows(accepted: list[int], k: int, next_k: int, bonus: bool) -> list[bool]:
    """Slots whose target holds its last logits (no bonus token): rows whose whole window was
    accepted with a next window announced, when the round takes no bonus (adaptive.takes_bonus)."""
    return [not bonus and next_k > 0 and a == k for a in accepted]


def window_len(next_k: int, bonus: bool) -> int:
    """Tokens to draft during the verify for a next window of next_k: one more when the
    target takes its bonus token (w_1 is then checked against it, not verified again)."""
    return next_k + 1 if bonus and next_k > 0 else next_k


# --- draft ---------------------------------------------------------------------------------
def drop_windows(draft: DraftShard, slots: list[int] | None = None) -> None:
    """Forget next windows (all, or these slots'), restoring the states without them."""
    for slot in list(draft.windows) if slots is None else slots:
        window = draft.windows.pop(slot, None)
        if window is not None:
            draft.slots[slot] = window.fallback


def take_drafts(draft: DraftShard, slots: list[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[bool]]:
    """This round's drafts: tokens [B, k] and q [B, k, V] (None when greedy): the windows
    drafted during the last round where the slot was kept, proposals for the others (made
    ahead while control travelled, or now); and which slots had a window (ready)."""
    windowed = [s for s in slots if s in draft.windows and
                draft.windows[s].tokens.shape[0] >= k]
    drop_windows(draft, [s for s in slots if s not in windowed])
    rest = [s for s in slots if s not in windowed]
    rest_tokens = rest_probs = None
    if rest:
        rest_tokens, rest_probs = draft.take_ahead(rest, k) or draft.propose(rest, k)
    greedy = draft.sampling(slots).greedy
    rows_t, rows_q = [], []
    for slot in slots:
        if slot in draft.windows:
            window = draft.windows.pop(slot)
            state = draft.slots[slot]
            state.cache_len = state.committed + k - 1        # as if proposed now
            tokens = window.tokens[:k]
            probs = None if greedy else _probs_of(window, tokens, k, draft)
        else:
            i = rest.index(slot)
            tokens = rest_tokens[i]
            probs = None if rest_probs is None else rest_probs[i]
        rows_t.append(tokens)
        rows_q.append(probs)
    probs = None if greedy else torch.stack(
        [q if q is not None else _one_hot(t, draft) for q, t in zip(rows_q, rows_t)])
    ready = [s in windowed for s in slots]
    return torch.stack(rows_t), probs, ready                            # [B, k], [B, k, V]


def _probs_of(window: DraftWindow, tokens: torch.Tensor, k: int, draft: DraftShard
              ) -> torch.Tensor:
    """q [k, V] of a window's first k tokens (one-hot when it was drafted greedily)."""
    return window.probs[:k] if window.probs is not None else _one_hot(tokens, draft)


def _one_hot(tokens: torch.Tensor, draft: DraftShard) -> torch.Tensor:
    """[k] greedy draft tokens -> their q [k, V]: what draft_choose gives a greedy row."""
    vocab = draft.model.vocab_size
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)


def draft_next_window(draft: DraftShard, slots: list[int], tokens: torch.Tensor,
                      probs: torch.Tensor | None, count: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """While the target verifies tokens [B, k]: decode on as if all are kept, `count` more
    per slot (window_len; tokens [B, count], q or None). None when a slot's cache has no
    room."""
    k = tokens.shape[1]
    saved = draft._save(slots)
    try:
        more, more_q = draft._continue(slots, list(tokens.unbind(1)),
                                       [] if probs is None else list(probs.unbind(1)),
                                       k + count, draft.sampling(slots),
                                       draft.committed_index(slots))
    except ValueError:          # past the cache: this slot is about to finish anyway
        draft._restore(slots, saved)
        return None
    return more[:, k:], None if more_q is None else more_q[:, k:]


def commit_draft(draft: DraftShard, slots: list[int], drafts: list[list[int]],
                 accepted: list[int], next_tokens: list[int], held: list[bool],
                 window: tuple[torch.Tensor, torch.Tensor | None] | None, bonus: bool
                 ) -> None:
    """The verdict on the draft. Kept slots keep their next window: with the target's bonus
    token (greedy) those that had all k accepted and guessed it as w_1 (they commit k + 1 and
    keep w_2..), else the held rows (they commit k). The others commit as in a plain round
    (the next window's KV is simply overwritten)."""
    kept = held
    if bonus and window is not None:
        firsts = window[0][:, 0].tolist()
        kept = [a == len(d) and w == n
                for d, a, n, w in zip(drafts, accepted, next_tokens, firsts)]
    plain = [i for i, keep in enumerate(kept) if not keep]
    if plain:
        draft.commit([slots[i] for i in plain], [drafts[i] for i in plain],
                     [accepted[i] for i in plain], [next_tokens[i] for i in plain])
    skip = 1 if bonus else 0                # the bonus token: w_1, now committed
    for i, slot in enumerate(slots):
        if not kept[i]:
            continue
        state = draft.slots[slot]
        committed = state.committed + len(drafts[i]) + skip
        last = next_tokens[i] if bonus else drafts[i][-1]
        fallback = replace(state, committed=committed, cache_len=committed - 1,
                           pending=[last])
        if window is None:
            draft.slots[slot] = fallback
            continue
        state.committed = committed          # cache_len: through the window's last but one
        state.pending = []
        tokens, probs = window
        draft.windows[slot] = DraftWindow(tokens[i, skip:],
                                          None if probs is None else probs[i, skip:], fallback)


# --- target --------------------------------------------------------------------------------
def verify_held(target: TargetShard, slots: list[int], draft_tokens: torch.Tensor,
                draft_probs: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TargetShard.verify where some slots hold the logits of their first draft's position
    (kept last round): those run over the k drafts alone. Returns accepted [B], next_token [B]
    and the logits at each slot's last position [B, V(local)] (held if the slot is kept)."""
    bsz, k = draft_tokens.shape
    held = [s in target.held for s in slots]
    if not any(held):
        pending = [target.slots[s].pending for s in slots]
        ids = torch.cat([to_device(pending, torch.long, target.device), draft_tokens],
                        dim=1)                                                 # [B, k+1]
        logits = target._step(slots, ids)                                      # [B, k+1, V]
    else:
        pad = torch.zeros(bsz, 1, dtype=torch.long, device=target.device)
        pending = to_device([target.slots[s].pending or [0] for s in slots], torch.long,
                            target.device)
        is_held = torch.tensor(held, device=target.device)[:, None]            # [B, 1]
        ids = torch.where(is_held, torch.cat([draft_tokens, pad], 1),
                          torch.cat([pending, draft_tokens], 1))               # [B, k+1]
        new = target._step(slots, ids, [k if h else k + 1 for h in held])      # [B, k+1, V]
        first = torch.stack([target.held[s] if h else new[i, 0]
                             for i, (s, h) in enumerate(zip(slots, held))])    # [B, V]
        shifted = torch.cat([first[:, None], new[:, :k]], dim=1)               # [B, k+1, V]
        logits = torch.where(is_held[:, :, None], shifted, new)
    accepted, next_token = target._choose(draft_tokens, logits, target.sampling(slots),
                                          target.committed_index(slots), draft_probs)
    return accepted, next_token, logits[:, k]


def commit_target(target: TargetShard, slots: list[int], accepted: list[int],
                  next_tokens: list[int], held: list[bool], last_logits: torch.Tensor) -> None:
    """Held slots commit their k drafts and hold the last position's logits (no pending
    token); the others commit as in a plain round (bonus token included)."""
    for i, slot in enumerate(slots):
        state = target.slots[slot]
        target.held.pop(slot, None)
        if held[i]:
            state.committed += accepted[i]   # = k; every input position is now cached
            state.cache_len = state.committed
            state.pending = []
            target.held[slot] = last_logits[i].clone()   # the step's output is reused
        else:
            target.commit([slot], [accepted[i]], [next_tokens[i]])
