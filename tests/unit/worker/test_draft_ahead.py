"""DraftShard.propose_ahead / take_ahead, and the next windows of overlapped rounds
(draft_window): drafting the next round before its command arrives must give exactly the
proposals (and states) of drafting on command."""

from __future__ import annotations

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.models import load_model
from runtime.worker.draft_shard import DraftShard

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
SAMPLED = Sampling(0.8, 0, 1.0, 7)


def shard(path: str, acceptance: str = "tokens", verification: str = "token") -> DraftShard:
    s = DraftShard(
        load_model(path, torch.float32, CPU),
        CPU,
        4,
        64,
        acceptance,
        max_step_len=2,
        verification=verification,
    )
    s.prefill([0, 2], [[5, 6, 7], [8, 9, 10, 11]], [SAMPLED, SAMPLED])
    return s


def one_round(s: DraftShard, slots: list[int], k: int, accepted: list[int]):
    """Propose (or take what was proposed ahead), then commit a made-up verdict."""
    tokens, probs = s.take_ahead(slots, k) or s.propose(slots, k)
    drafts = tokens.tolist()
    s.commit(slots, drafts, accepted, [40 + a for a in accepted])
    return drafts, probs


@pytest.mark.parametrize("acceptance", ["tokens", "logits"])
def test_ahead_equals_on_command(llama_path, acceptance):
    ahead, plain = shard(llama_path, acceptance), shard(llama_path, acceptance)
    slots = [0, 2]
    for k, accepted in [(4, [4, 1]), (4, [0, 4]), (3, [3, 2]), (6, [6, 1]), (2, [2, 2])]:
        got, got_q = one_round(ahead, slots, k, accepted)
        want, want_q = one_round(plain, slots, k, accepted)
        assert got == want
        if acceptance == "logits":
            torch.testing.assert_close(got_q, want_q)
        ahead.propose_ahead(slots, 4)  # the next round's k: fewer, or continued to more
    ahead.drop_ahead()
    assert [vars(s) for s in ahead.slots] == [vars(s) for s in plain.slots]


def test_mismatch_restores_states(llama_path):
    s = shard(llama_path)
    before = [vars(st).copy() for st in s.slots]
    s.propose_ahead([0, 2], 2)  # the work is in the record; the states stay as they were
    assert s.ahead is not None and [vars(st) for st in s.slots] == before
    assert s.take_ahead([0], 2) is None  # other slots: dropped
    assert [vars(st) for st in s.slots] == before
    s.propose_ahead([0, 2], 2)
    s.drop_ahead()  # prefill/release arrived instead
    assert [vars(st) for st in s.slots] == before and s.ahead is None


@pytest.mark.parametrize("verification", ["token", "block"])
def test_window_drafted_during_the_verify_equals_a_fresh_proposal(llama_path, verification):
    """`logits` acceptance, overlap: the next window drafted while the target verifies this
    one equals what the draft would propose once the window is kept (its k drafts committed,
    the target's logits held): under block verification its samples are keyed by the next
    window (rng.window_uniform), as a fresh proposal's are."""
    early, late = (shard(llama_path, "logits", verification) for _ in range(2))
    slots, k, m = [0, 2], 3, 4
    drafts, probs = early.propose(slots, k)
    assert torch.equal(late.propose(slots, k)[0], drafts)
    window = early.draft_window(slots, drafts, probs, m)
    assert window is not None
    for i, slot in enumerate(slots):
        late.commit_kept(slot, k, int(drafts[i, -1]), None, None)
    fresh, fresh_q = late.propose(slots, m)
    assert torch.equal(window[0], fresh)
    torch.testing.assert_close(window[1], fresh_q)
