"""A draft with another tokenizer on a worker (runtime.worker.cross): proposals of any length
per slot verified at once, and the draft's rollback to the positions it keeps."""

from __future__ import annotations

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.speculation.acceptance import accept_choices
from runtime.worker.cross import _verify_ragged
from runtime.worker.slot_state import SlotBook


class ChoosingTarget:
    """A target whose own choice at each position is fixed (as under `tokens` acceptance:
    it does not depend on the proposal at that position)."""

    device = torch.device("cpu")

    def __init__(self, choices: list[list[int]]):
        self.choices = torch.tensor(choices)

    def verify(self, slots, proposals):
        return accept_choices(proposals, self.choices[:, : proposals.shape[1] + 1])


def test_rows_of_other_lengths_keep_none_past_their_own():
    # row 0: 3 proposals, 2 match; row 1: 1 proposal, it and its padding (0) "match":
    # it keeps 1 and takes the target's choice there (the pad's value 0); row 2: none
    target = ChoosingTarget([[4, 5, 9, 7], [3, 0, 8, 8], [6, 1, 1, 1]])
    verdict = _verify_ragged(target, [0, 1, 2], [[4, 5, 6], [3], []]).tolist()
    assert verdict == [[2, 9], [1, 0], [0, 6]]


def test_no_proposals_at_all():
    target = ChoosingTarget([[4], [2]])
    assert _verify_ragged(target, [0, 1], [[], []]).tolist() == [[0, 4], [0, 2]]


def test_rewind_keeps_a_prefix_of_the_cache():
    b = SlotBook(1, 64, True)
    b.start(0, [5, 6, 7, 8], Sampling(0.0, 0, 1.0, 0))
    b.append([0], [3 + 4])  # the prompt but its last, then a round's proposals
    b.rewind(0, 5, [9, 10])  # 5 positions kept, two new tokens
    s = b[0]
    assert (s.cache_len, s.committed, s.pending) == (5, 7, [10])
    b.append([0], [1])  # the new tokens but the last are fed (a prefill)
    assert s.cache_len + len(s.pending) == s.committed
    with pytest.raises(ValueError):
        b.rewind(0, 9, [1])  # past the cache
    with pytest.raises(ValueError):
        b.rewind(0, 0, [1])  # a new sequence: start


def test_the_commands_cross_the_wire():
    from dataclasses import replace

    from runtime.control import commands, protocol, wire

    params = commands.Sampling(0.5, 3, 0.9, 4)
    draft = commands.CrossDraftCommand([1, 3], 4, [0, 7], [[5, 6], [2]], [params, params])
    verify = commands.CrossVerifyCommand([1, 3], [[8, 9, 10], []], [[4], []])
    for cmd in (draft, verify):
        stamped = replace(cmd, step=2)
        assert protocol.decode(protocol.encode(stamped)) == stamped
    with pytest.raises(protocol.ProtocolError, match="a slot with no tokens"):
        protocol.from_wire(dict(wire.to_wire(draft), tokens=[[5], []]))
