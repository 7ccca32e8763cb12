"""Target-only rounds (draft_len auto, k = 0): the target decodes several tokens on one
command. They must be exactly the tokens verify rounds with every draft rejected would take,
and leave both shards' states as if those tokens had been committed one by one."""

from __future__ import annotations

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.models import load_model
from runtime.worker.draft_shard import DraftShard
from runtime.worker.target_shard import TargetShard

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
GREEDY = Sampling(0.0, 0, 1.0, 0)
SAMPLED = Sampling(0.9, 0, 0.95, 11)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
SLOTS = [0, 2]


def make(cls, path, params, acceptance="tokens"):
    shard = cls(load_model(path, torch.float32, CPU), CPU, 4, 64, acceptance, max_step_len=5)
    shard.prefill(SLOTS, PROMPTS, [params, params])
    return shard


def states(shard):
    return [(s.committed, s.cache_len, list(s.pending)) for s in shard.slots]


@pytest.mark.parametrize(
    "acceptance,params", [("tokens", GREEDY), ("tokens", SAMPLED), ("logits", SAMPLED)]
)
def test_decode_equals_rounds_that_reject_every_draft(llama_path, acceptance, params):
    alone, rounds = (
        make(TargetShard, llama_path, params, acceptance),
        make(TargetShard, llama_path, params, acceptance),
    )
    rows = alone.decode(SLOTS, 5).tolist()
    alone.append_decoded(SLOTS, rows)
    expected = [[] for _ in SLOTS]
    no_drafts = torch.zeros(len(SLOTS), 0, dtype=torch.long)
    vocab = alone.model.vocab_size
    probs = torch.zeros(len(SLOTS), 0, vocab) if acceptance == "logits" else None
    for _ in range(5):
        accepted, nxt = rounds.verify(SLOTS, no_drafts, probs)
        assert accepted.tolist() == [0, 0]
        rounds.commit(SLOTS, [0, 0], nxt.tolist())
        for row, tok in zip(expected, nxt.tolist()):
            row.append(tok)
    assert rows == expected
    assert states(alone) == states(rounds)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])  # the caches hold the same positions too
    p = torch.full((2, 3, vocab), 1 / vocab) if acceptance == "logits" else None
    assert [t.tolist() for t in alone.verify(SLOTS, drafts, p)] == [
        t.tolist() for t in rounds.verify(SLOTS, drafts, p)
    ]


def test_draft_takes_the_decoded_tokens_as_pending(llama_path):
    """A draft that was handed decoded tokens proposes what a draft whose prompt already
    held them proposes."""
    handed = make(DraftShard, llama_path, GREEDY)
    rows = [[20, 21, 22], [30, 31, 32]]
    handed.append_decoded(SLOTS, rows)
    assert [s.pending for s in (handed.slots[0], handed.slots[2])] == [
        [7, 20, 21, 22],
        [12, 30, 31, 32],
    ]
    fresh = DraftShard(
        load_model(llama_path, torch.float32, CPU), CPU, 4, 64, "tokens", max_step_len=5
    )
    fresh.prefill(SLOTS, [p + r for p, r in zip(PROMPTS, rows)], [GREEDY, GREEDY])
    assert handed.propose(SLOTS, 3)[0].tolist() == fresh.propose(SLOTS, 3)[0].tolist()
    assert [s[:2] for s in states(handed)] == [s[:2] for s in states(fresh)]


def test_decode_needs_one_pending_token(llama_path):
    shard = make(TargetShard, llama_path, GREEDY)
    shard.slots[0].pending = [1, 2]
    with pytest.raises(RuntimeError, match="one pending token"):
        shard.decode(SLOTS, 2)


def decode_calls(shard, calls):
    """Target-only rounds of these (ahead steps before the round, steps) on SLOTS: every
    round's tokens, committed one round after the other."""
    rows = []
    for ahead, steps in calls:
        if ahead:
            shard.decode_ahead(SLOTS, ahead)
        out = shard.decode(SLOTS, steps).tolist()
        shard.append_decoded(SLOTS, out)
        rows.append(out)
    return rows


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_steps_decoded_ahead_change_nothing(llama_path, params):
    """A round takes the steps decoded ahead (fewer, as many or more than it wants) and
    decodes the rest: tokens and states equal those of rounds decoded on command."""
    calls = [(0, 2), (1, 3), (4, 3), (2, 2), (1, 1)]
    plain, ahead = make(TargetShard, llama_path, params), make(TargetShard, llama_path, params)
    assert decode_calls(ahead, calls) == decode_calls(plain, [(0, s) for _, s in calls])
    assert ahead.ahead is None and states(ahead) == states(plain)


def test_steps_decoded_ahead_are_dropped_by_other_work(llama_path):
    """Ahead steps leave the states alone; for other slots, after a verify round or
    dropped, they are not taken."""
    plain, ahead = make(TargetShard, llama_path, GREEDY), make(TargetShard, llama_path, GREEDY)
    ahead.decode_ahead(SLOTS, 3)
    assert ahead.ahead is not None and states(ahead) == states(plain)
    assert ahead.decode(SLOTS[:1], 2).tolist() == plain.decode(SLOTS[:1], 2).tolist()
    assert states(ahead) == states(plain)
    drafts = torch.tensor([[1, 2], [3, 4]])
    for shard in (plain, ahead):  # a verify round, committed, between ahead and decode
        if shard is ahead:
            shard.decode_ahead(SLOTS, 2)
        accepted, nxt = shard.verify(SLOTS, drafts)
        shard.commit(SLOTS, accepted.tolist(), nxt.tolist())
    assert ahead.decode(SLOTS, 2).tolist() == plain.decode(SLOTS, 2).tolist()
    ahead.decode_ahead(SLOTS, 2)
    ahead.drop_ahead()
    assert [t.tolist() for t in ahead.verify(SLOTS, drafts)] == [
        t.tolist() for t in plain.verify(SLOTS, drafts)
    ]
    assert states(ahead) == states(plain)


def test_decode_ahead_past_the_cache_does_nothing(llama_path):
    shard = make(TargetShard, llama_path, GREEDY)
    before = states(shard)
    shard.decode_ahead(SLOTS, 100)  # beyond the 64-position cache: not now
    assert shard.ahead is None and states(shard) == before


def test_the_first_token_comes_with_the_prefill(llama_path):
    """TargetShard.prefill_first feeds the whole prompt and picks the token a target-only
    step would (greedy: the argmax at the last prompt token; sampled: the same draw as a
    decode step at that index); committed like a target-only round, the slot stands where a
    prefill and one decode step leave it."""
    for params in (GREEDY, Sampling(0.9, 0, 1.0, 5)):
        first_way, decode_way = (
            TargetShard(
                load_model(llama_path, torch.float32, CPU), CPU, num_slots=4, max_seq_len=64
            )
            for _ in range(2)
        )
        first = first_way.prefill_first(SLOTS, PROMPTS, [params, params])  # [B, 1]
        decode_way.prefill(SLOTS, PROMPTS, [params, params])
        assert first.tolist() == decode_way.decode(SLOTS, 1).tolist()
        rows = first.tolist()
        first_way.append_decoded(SLOTS, rows)
        decode_way.append_decoded(SLOTS, rows)
        for slot in SLOTS:
            a, b = first_way.slots[slot], decode_way.slots[slot]
            assert (a.committed, a.cache_len, a.pending) == (b.committed, b.cache_len, b.pending)
        assert first_way.decode(SLOTS, 3).tolist() == decode_way.decode(SLOTS, 3).tolist()


def test_a_prefill_leaves_both_models_with_the_whole_prompt_and_the_first_token_pending(llama_path):
    """runtime.worker.round.prefill on one worker hosting both models: a prompt's end is
    cached whole by the draft too (every rank reports the whole prompt cached, so its last
    block can be indexed even when the request ends at its first token); a chunk keeps its
    last token pending on both."""
    from runtime.worker.round import RoundParts, prefill

    draft = DraftShard(load_model(llama_path, torch.float32, CPU), CPU, 4, 64)
    target = TargetShard(load_model(llama_path, torch.float32, CPU), CPU, 4, 64)
    parts = RoundParts(draft, target, None, 0, 0, 0, CPU, "tokens")
    long = [3, 4, 5, 6, 7, 8, 9]
    reply = prefill(
        parts, SLOTS, [PROMPTS[0], long[:4]], [GREEDY, GREEDY], [0, 0], [], [True, False]
    )
    first = reply.tokens[0]
    assert len(first) == 1 and reply.tokens[1] == []
    for shard in (draft, target):
        assert (shard.slots[0].cache_len, shard.slots[0].pending) == (3, first)
        assert (shard.slots[2].cache_len, shard.slots[2].pending) == (3, [6])
    reply = prefill(parts, [2], [long[3:]], [GREEDY], [3], [], [True])
    for shard in (draft, target):
        assert (shard.slots[2].cache_len, shard.slots[2].pending) == (7, reply.tokens[0])
        assert shard.slots[2].committed == 8
