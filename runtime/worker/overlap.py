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

This module decides which rows keep what; the shards change their states (DraftShard:
draft_window, take_window, commit_kept; TargetShard: verify_with_last, commit_held), and a
next window is a slot_state.Extension like any work done ahead.
"""

from __future__ import annotations

import torch

from runtime.worker.draft_shard import DraftShard


def held_rows(accepted: list[int], k: int, next_k: int, bonus: bool) -> list[bool]:
    """Slots whose target holds its last logits (no bonus token): rows whose whole window was
    accepted with a next window announced, when the round takes no bonus (adaptive.takes_bonus)."""
    return [not bonus and next_k > 0 and a == k for a in accepted]


def window_len(next_k: int, bonus: bool) -> int:
    """Tokens to draft during the verify for a next window of next_k: one more when the
    target takes its bonus token (w_1 is then checked against it, not verified again)."""
    return next_k + 1 if bonus and next_k > 0 else next_k


def take_drafts(
    draft: DraftShard, slots: list[int], k: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[bool]]:
    """This round's drafts: tokens [B, k] and q [B, k, V] (None when greedy): the windows
    drafted during the last round where the slot was kept, proposals for the others (made
    ahead while control travelled, or now); and which slots had a window (ready)."""
    ready = [draft.has_window(s, k) for s in slots]
    rest = [s for s, r in zip(slots, ready) if not r]
    draft.drop_windows(rest)
    rest_tokens = rest_probs = None
    if rest:
        rest_tokens, rest_probs = draft.take_ahead(rest, k) or draft.propose(rest, k)
    greedy = draft.greedy(slots)
    rows_t, rows_q = [], []
    for slot, windowed in zip(slots, ready):
        if windowed:
            tokens, probs = draft.take_window(slot, k)
        else:
            i = rest.index(slot)
            assert rest_tokens is not None  # the slot is one of `rest`
            tokens = rest_tokens[i]
            probs = None if rest_probs is None else rest_probs[i]
        rows_t.append(tokens)
        rows_q.append(None if greedy else probs)
    probs = (
        None
        if greedy
        else torch.stack(
            [q if q is not None else _one_hot(t, draft) for q, t in zip(rows_q, rows_t)]
        )
    )
    return torch.stack(rows_t), probs, ready  # [B, k], [B, k, V]


def _one_hot(tokens: torch.Tensor, draft: DraftShard) -> torch.Tensor:
    """[k] greedy draft tokens -> their q [k, V]: what draft_choose gives a greedy row."""
    return torch.nn.functional.one_hot(tokens, draft.q_width).to(torch.float32)


def commit_draft(
    draft: DraftShard,
    slots: list[int],
    drafts: list[list[int]],
    accepted: list[int],
    next_tokens: list[int],
    held: list[bool],
    window: tuple[torch.Tensor, torch.Tensor | None] | None,
    bonus: bool,
) -> None:
    """The verdict on the draft. Kept slots keep their next window: with the target's bonus
    token (greedy) those that had all k accepted and guessed it as w_1 (they commit k + 1 and
    keep w_2..), else the held rows (they commit k). The others commit as in a plain round
    (the next window's KV is simply overwritten)."""
    kept = held
    if bonus and window is not None:
        firsts = window[0][:, 0].tolist()
        kept = [a == len(d) and w == n for d, a, n, w in zip(drafts, accepted, next_tokens, firsts)]
    plain = [i for i, keep in enumerate(kept) if not keep]
    if plain:
        draft.commit(
            [slots[i] for i in plain],
            [drafts[i] for i in plain],
            [accepted[i] for i in plain],
            [next_tokens[i] for i in plain],
        )
    skip = 1 if bonus else 0  # the bonus token: w_1, now committed
    for i, slot in enumerate(slots):
        if not kept[i]:
            continue
        last = next_tokens[i] if bonus else drafts[i][-1]
        tokens, probs = window if window is not None else (None, None)
        draft.commit_kept(
            slot,
            len(drafts[i]) + skip,
            last,
            None if tokens is None else tokens[i, skip:],
            None if probs is None else probs[i, skip:],
        )
