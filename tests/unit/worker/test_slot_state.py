"""runtime.worker.slot_state: the one owner of a slot's lengths and pending tokens. Its
operations keep cache_len + len(pending) == committed at every commit, rollback restores
lengths exactly, and no other module of the product writes them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.worker.slot_state import Extension, SlotBook

ROOT = Path(__file__).resolve().parents[3]
OWNER = ROOT / "runtime" / "worker" / "slot_state.py"
SHARDS = ROOT / "runtime" / "worker" / "shards.py"
STATE_FIELDS = {"cache_len", "committed", "pending"}
SHARD_PRIVATE = {"_save", "_restore", "_continue", "_step", "_choose", "_take_ahead"}


def _product_modules():
    for package in ("runtime", "launcher", "parallel"):
        yield from (ROOT / package).rglob("*.py")


def _state_writes(tree: ast.AST, fields: set[str] = STATE_FIELDS) -> list[int]:
    """Lines that assign a slot-state field: `x.cache_len = ...`, `x.pending += ...`, or
    dataclasses.replace(..., cache_len=...)."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in fields:
                    lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "replace"
            and any(k.arg in fields for k in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def _foreign_private_calls(tree: ast.AST) -> list[int]:
    """Lines that reach a shard's private method on another object than self."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in SHARD_PRIVATE
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]


def test_only_the_owner_writes_slot_lengths():
    """cache_len and committed nowhere else in the product; pending (a common word: the
    server's pending requests) nowhere else in runtime/worker/."""
    bad = {}
    for path in _product_modules():
        if path != OWNER:
            fields = STATE_FIELDS if path.parent == OWNER.parent else STATE_FIELDS - {"pending"}
            lines = _state_writes(ast.parse(path.read_text()), fields)
            if lines:
                bad[str(path.relative_to(ROOT))] = lines
    assert not bad, f"slot state written outside runtime/worker/slot_state.py: {bad}"


def test_nobody_calls_the_shards_private_methods():
    bad = {}
    for path in _product_modules():
        if path not in (OWNER, SHARDS):
            lines = _foreign_private_calls(ast.parse(path.read_text()))
            if lines:
                bad[str(path.relative_to(ROOT))] = lines
    assert not bad, f"shard internals called from outside: {bad}"


def test_the_checks_catch_writes_and_private_calls():
    tree = ast.parse(
        "s.cache_len = 3\nstate.pending += [1]\nreplace(s, committed=2)\n"
        "draft._continue(x)\nself._step(y)\n"
    )
    assert _state_writes(tree) == [1, 2, 3]
    assert _foreign_private_calls(tree) == [4]


# --- behaviour -------------------------------------------------------------------------------
def book(refeeds_last: bool, prompt=(5, 6, 7, 8), max_seq_len: int = 64) -> SlotBook:
    """One slot after a prefill of `prompt` (every token but the last cached)."""
    b = SlotBook(2, max_seq_len, refeeds_last)
    b.start(1, list(prompt), Sampling(0.0, 0, 1.0, 0))
    b.append([1], [len(prompt) - 1])
    return b


def invariant(b: SlotBook, slot: int = 1) -> bool:
    s = b[slot]
    return s.cache_len + len(s.pending) == s.committed


def test_start_and_append():
    b = book(True)
    assert (b[1].committed, b[1].cache_len, b[1].pending) == (4, 3, [8]) and invariant(b)
    assert b.append([1], [2]) == [3] and b[1].cache_len == 5
    with pytest.raises(ValueError, match="max_seq_len"):
        b.append([1], [60])
    assert b[1].cache_len == 5  # a refused step leaves the lengths alone
    with pytest.raises(ValueError, match="out of range"):
        b.start(2, [1], Sampling(0.0, 0, 1.0, 0))


def test_rollback_restores_lengths_exactly():
    b = book(True)
    before = [vars(s).copy() for s in b]
    marks = b.mark([0, 1])
    b.append([1], [1])  # the pending token
    b.append([1], [1])  # a proposal
    b.rollback([0, 1], marks)
    assert [vars(s) for s in b] == before


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_draft_commit_keeps_the_accepted_drafts_among_the_first_k_minus_1(accepted):
    """A draft proposed k = 3 (fed pending + d1, d2): the verdict keeps what was fed and
    accepted; the rest is pending, d3 too when every draft was accepted."""
    b, k, drafts = book(True), 3, [11, 12, 13]
    b.append([1], [1 + k - 1])
    tokens = drafts[:accepted] + [40]
    b.commit(1, accepted + 1, min(accepted, k - 1), tokens[-2:])
    s = b[1]
    assert s.committed == 4 + accepted + 1 and invariant(b)
    assert s.pending == ([13, 40] if accepted == k else [40])
    assert s.cache_len == 4 + min(accepted, k - 1)


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_target_commit_caches_every_accepted_draft(accepted):
    b, k = book(False), 3
    b.append([1], [1 + k])  # pending + every draft
    b.commit(1, accepted + 1, accepted, [40])
    assert (b[1].committed, b[1].cache_len, b[1].pending) == (5 + accepted, 4 + accepted, [40])


def test_held_commit_caches_everything_and_a_draft_refeeds_its_last_token():
    target, draft = book(False), book(True)
    target.append([1], [1 + 3])
    target.commit(1, 3, 3, [])  # k drafts kept, no bonus: the target holds logits
    assert (target[1].committed, target[1].cache_len, target[1].pending) == (7, 7, [])
    draft.append([1], [1 + 3 + 2])  # pending, 3 drafts, and 2 of a next window
    draft.commit(1, 3, 3, [13])
    assert (draft[1].committed, draft[1].cache_len, draft[1].pending) == (7, 6, [13])
    assert invariant(target) and invariant(draft)


def test_target_only_rows_join_the_pending_tokens_of_a_draft_that_fed_nothing():
    draft, target = book(True), book(False)
    target.append([1], [3])  # pending + 2 of 3 decoded tokens
    for b in (draft, target):
        b.commit(1, 3, 3, [20, 21, 22])
    assert draft[1].pending == [8, 20, 21, 22] and draft[1].cache_len == 3
    assert target[1].pending == [22] and target[1].cache_len == 6
    assert invariant(draft) and invariant(target)


def test_an_extension_fits_its_slots_as_they_stood_and_take_extends_over_it():
    b = book(True)
    marks = b.mark([1])
    b.append([1], [1 + 3])  # pending + 3 of 4 proposals, made ahead
    b.rollback([1], marks)
    ext = Extension([1], torch.tensor([[11, 12, 13, 14]]), None, marks)
    assert b.fits(ext, [1]) and not b.fits(ext, [0, 1]) and not b.fits(None, [1])
    b.take(ext, 2)  # the round wants 2: pending + 1 proposal cached
    assert b[1].cache_len == 3 + 1 + 1
    b.take(ext, 9)  # more than were made: all of them
    assert b[1].cache_len == 3 + 1 + 3
    b.rollback([1], marks)
    b.commit(1, 1, 0, [40])  # the states moved on: it no longer fits
    assert not b.fits(ext, [1])
