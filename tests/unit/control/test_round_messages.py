"""Step commands and their replies as typed records (runtime.control.commands): every field
sent, round trips through msgpack, malformed ones refused with ProtocolError."""

from __future__ import annotations

import msgpack
import pytest

from runtime.control import commands, protocol
from runtime.control.commands import (
    TARGET_LEADER,
    WORKER,
    PrefillCommand,
    ReleaseCommand,
    RoundCommand,
    RoundReply,
    StepAck,
)
from runtime.control.protocol import ProtocolError

pytestmark = pytest.mark.timeout(30)

PARAMS = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}


def wire(msg: dict, key: bytes | None = None) -> dict:
    return protocol.decode(protocol.encode(msg, key), key)


@pytest.mark.parametrize(
    "cmd",
    [
        RoundCommand([0, 2], 4, 3),
        RoundCommand([1], 0, 0, steps=8),
        RoundCommand([1, 4], 2, 2, tables=[[], [7, 9]]),
        PrefillCommand([0, 3], [[1, 2, 3], [4]], [PARAMS, PARAMS]),
        PrefillCommand([0, 3], [[1, 2, 3], [4]], [PARAMS, PARAMS], [2, 0], [[5], [6, 8]]),
        PrefillCommand(
            [0, 3], [[1, 2, 3], [4]], [PARAMS, PARAMS], [32, 0], [[5], [6]], [False, True]
        ),
        ReleaseCommand([2, 5]),
    ],
)
def test_commands_round_trip(cmd):
    msg = wire(dict(cmd.to_msg(), step=7), b"k" * 32)
    assert commands.command(msg) == cmd and type(cmd).from_msg(msg) == cmd


def test_round_command_sends_every_field_and_reads_the_short_form():
    assert RoundCommand([0], 4, 2).to_msg() == {
        "type": "round",
        "slots": [0],
        "k": 4,
        "steps": 1,
        "next_k": 2,
        "tables": [],
    }
    short = wire({"type": "round", "step": 1, "slots": [0], "k": 4})
    assert RoundCommand.from_msg(short) == RoundCommand([0], 4, next_k=4, steps=1)


@pytest.mark.parametrize(
    "msg,match",
    [
        ({"type": "round", "step": 1, "slots": [0, True], "k": 4}, "round.slots"),
        ({"type": "round", "step": 1, "slots": [0], "k": "4"}, "round.k"),
        ({"type": "round", "step": 1, "slots": [0], "k": 4, "next_k": 1.5}, "round.next_k"),
        ({"type": "round", "step": 1, "slots": [0], "k": 4, "draft": 1}, "unknown fields"),
        ({"type": "release", "step": 1, "slots": ["0"]}, "release.slots"),
        (
            {"type": "prefill", "step": 1, "slots": [0], "prompts": [[1]], "params": []},
            "differ in length",
        ),
        (
            {"type": "prefill", "step": 1, "slots": [0], "prompts": [[1.0]], "params": [PARAMS]},
            "prefill.prompts",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1, 2]],
                "params": [PARAMS],
                "cached": [-1],
            },
            "prefill.cached",
        ),
        (
            {"type": "prefill", "step": 1, "slots": [0], "prompts": [[]], "params": [PARAMS]},
            "non-empty",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1]],
                "params": [PARAMS],
                "final": [False],
            },
            "a chunk: at least 2",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1]],
                "params": [PARAMS],
                "final": [1],
            },
            "prefill.final",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1]],
                "params": [PARAMS],
                "tables": [[1], [2]],
            },
            "tables differ in length",
        ),
        (
            {"type": "round", "step": 1, "slots": [0], "k": 4, "tables": [[1], []]},
            "tables differ in length",
        ),
        ({"type": "shutdown"}, "not a step command"),
        ({"type": "hello", "rank": 1, "pid": 2, "host": "h"}, "not a step command"),
    ],
)
def test_malformed_commands_are_refused(msg, match):
    with pytest.raises(ProtocolError, match=match):
        commands.command(msg)


def test_a_command_of_another_kind_is_refused():
    with pytest.raises(ProtocolError, match="expected a round command"):
        RoundCommand.from_msg(dict(ReleaseCommand([0]).to_msg(), step=1))


LEADER = RoundReply(
    TARGET_LEADER, 0.25, {"draft_s": 0.1}, [[3, 4], [9]], [1, 0], [True, False], [32, 17]
)


@pytest.mark.parametrize(
    "reply", [LEADER, RoundReply(WORKER, 0.5), RoundReply(TARGET_LEADER, 1.0, {}, [[7]], [0], [])]
)
def test_round_replies_round_trip_in_a_done_message(reply):
    msg = wire({"type": "done", "rank": 2, "step": 4, "result": reply.to_map()}, b"k" * 32)
    got = RoundReply.from_map(msg["result"])
    assert got == reply and got.reports == (reply.role == TARGET_LEADER)


def test_replies_carry_every_field_and_a_kind():
    assert RoundReply(WORKER, 0.5).to_map() == {
        "kind": "round",
        "role": "worker",
        "worker_s": 0.5,
        "timing": {},
        "tokens": [],
        "accepted": [],
        "overlapped": [],
        "cached": [],
    }
    assert (
        StepAck.from_map(
            wire({"type": "done", "rank": 1, "step": 1, "result": StepAck().to_map()})["result"]
        )
        == StepAck()
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"kind": "ack"}, "expected a round reply"),
        ({"kind": None}, "expected a round reply"),
        ({"role": "leader"}, "unknown role"),
        ({"worker_s": "0.1"}, "worker_s"),
        ({"tokens": [[1, 2.5], [9]]}, "tokens"),
        ({"tokens": [[1]]}, "differ in length"),
        ({"accepted": [1, None]}, "accepted"),
        ({"overlapped": [1, 0]}, "overlapped"),
        ({"overlapped": [True]}, "differ in length"),
        ({"timing": {"draft_s": "fast"}}, "timing"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_malformed_round_replies_are_refused(change, match):
    result = dict(LEADER.to_map(), **change)
    with pytest.raises(ProtocolError, match=match):
        RoundReply.from_map(result)


@pytest.mark.parametrize(
    "field", ["role", "worker_s", "timing", "tokens", "accepted", "overlapped"]
)
def test_a_round_reply_missing_a_field_is_refused(field):
    result = LEADER.to_map()
    del result[field]
    with pytest.raises(ProtocolError, match=f"missing field '{field}'"):
        RoundReply.from_map(msgpack.unpackb(msgpack.packb(result)))


def test_only_the_target_leader_reports_tokens():
    result = dict(RoundReply(WORKER, 0.1).to_map(), tokens=[[1]], accepted=[0])
    with pytest.raises(ProtocolError, match="only the target leader"):
        RoundReply.from_map(result)
    with pytest.raises(ProtocolError, match="expected a ack reply"):
        StepAck.from_map([])
