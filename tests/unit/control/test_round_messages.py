"""Step commands and their replies as typed records (runtime.control.commands): every field
sent, round trips through msgpack, malformed ones refused with ProtocolError."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from runtime.control import protocol, wire
from runtime.control.commands import (
    TARGET_LEADER,
    WORKER,
    PrefillCommand,
    ReleaseCommand,
    RoundCommand,
    RoundReply,
    Sampling,
    StepAck,
)
from runtime.control.protocol import Done, ProtocolError

pytestmark = pytest.mark.timeout(30)

PARAMS = Sampling(0.7, 0, 0.9, 3)
PARAMS_MAP = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}


def through(msg: protocol.Message, key: bytes | None = None) -> protocol.Message:
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
    stamped = replace(cmd, step=7)
    assert through(stamped, b"k" * 32) == stamped


def test_round_command_sends_every_field_and_reads_the_short_form():
    assert wire.to_wire(RoundCommand([0], 4, 2)) == {
        "type": "round",
        "step": 0,
        "slots": [0],
        "k": 4,
        "steps": 1,
        "next_k": 2,
        "tables": [],
    }
    short = protocol.from_wire({"type": "round", "step": 1, "slots": [0], "k": 4})
    assert short == RoundCommand([0], 4, next_k=4, steps=1, step=1)


def test_a_prefill_sends_sampling_params_as_maps():
    sent = wire.to_wire(PrefillCommand([0], [[1, 2]], [PARAMS], step=1))
    (params,) = sent["params"]
    assert {k: params[k] for k in PARAMS_MAP} == PARAMS_MAP  # and the processors, off
    assert Sampling.of(params) == PARAMS
    assert sent["cached"] == [0] and sent["final"] == [True]


@pytest.mark.parametrize(
    "msg,match",
    [
        ({"type": "round", "step": 1, "slots": [0, True], "k": 4}, "round.slots"),
        ({"type": "round", "step": 1, "slots": [0], "k": "4"}, "round.k"),
        ({"type": "round", "step": 1, "slots": [0], "k": 4, "next_k": 1.5}, "round.next_k"),
        ({"type": "round", "step": 1, "slots": [0], "k": 4, "draft": 1}, "unknown fields"),
        ({"type": "round", "slots": [0], "k": 4}, "missing field 'step'"),
        ({"type": "release", "step": 1, "slots": ["0"]}, "release.slots"),
        (
            {"type": "prefill", "step": 1, "slots": [0], "prompts": [[1]], "params": []},
            "differ in length",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1.0]],
                "params": [PARAMS_MAP],
            },
            "prefill.prompts",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1]],
                "params": [dict(PARAMS_MAP, top_p=2.0)],
            },
            "params out of range",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1, 2]],
                "params": [PARAMS_MAP],
                "cached": [-1],
            },
            "prefill.cached",
        ),
        (
            {"type": "prefill", "step": 1, "slots": [0], "prompts": [[]], "params": [PARAMS_MAP]},
            "non-empty",
        ),
        (
            {
                "type": "prefill",
                "step": 1,
                "slots": [0],
                "prompts": [[1]],
                "params": [PARAMS_MAP],
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
                "params": [PARAMS_MAP],
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
                "params": [PARAMS_MAP],
                "tables": [[1], [2]],
            },
            "tables differ in length",
        ),
        (
            {"type": "round", "step": 1, "slots": [0], "k": 4, "tables": [[1], []]},
            "tables differ in length",
        ),
        (
            {"type": "verify_cross", "step": 1, "slots": [0], "proposals": [[1]]},
            "missing field 'tables'",
        ),
    ],
)
def test_malformed_commands_are_refused(msg, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(msgpack.packb(msg))


LEADER = RoundReply(
    TARGET_LEADER, 0.25, {"draft_s": 0.1}, [[3, 4], [9]], [1, 0], [True, False], [32, 17]
)


@pytest.mark.parametrize(
    "reply",
    [
        LEADER,
        RoundReply(WORKER, 0.5),
        RoundReply(TARGET_LEADER, 1.0, {}, [[7]], [0], []),
        replace(LEADER, grammar_failures=["", "lexer error: too many states"]),
    ],
)
def test_round_replies_round_trip_in_a_done_message(reply):
    got = through(Done(2, 4, reply), b"k" * 32)
    assert got == Done(2, 4, reply) and got.result.reports == (reply.role == TARGET_LEADER)


def test_replies_carry_every_field_and_a_kind():
    assert wire.to_wire(Done(1, 1, RoundReply(WORKER, 0.5)))["result"] == {
        "kind": "round",
        "role": "worker",
        "worker_s": 0.5,
        "timing": {},
        "tokens": [],
        "accepted": [],
        "overlapped": [],
        "cached": [],
    }
    assert wire.to_wire(Done(1, 1, StepAck()))["result"] == {"kind": "ack"}
    assert through(Done(1, 1, StepAck())) == Done(1, 1, StepAck())


def done(result) -> dict:
    return {"type": "done", "rank": 2, "step": 4, "result": result}


@pytest.mark.parametrize(
    "change,match",
    [
        ({"kind": "ack"}, "ack reply: unknown fields"),
        ({"kind": None}, "expected kind 'round' or 'ack'"),
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
    result = dict(wire.to_wire(Done(2, 4, LEADER))["result"], **change)
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(msgpack.packb(done(result)))


@pytest.mark.parametrize(
    "field", ["role", "worker_s", "timing", "tokens", "accepted", "overlapped", "cached"]
)
def test_a_round_reply_missing_a_field_is_refused(field):
    result = wire.to_wire(Done(2, 4, LEADER))["result"]
    del result[field]
    with pytest.raises(ProtocolError, match=f"missing field '{field}'"):
        protocol.decode(msgpack.packb(done(result)))


def test_only_the_target_leader_reports_tokens():
    result = dict(wire.to_wire(Done(2, 4, RoundReply(WORKER, 0.1)))["result"])
    with pytest.raises(ProtocolError, match="only the target leader"):
        protocol.from_wire(done(dict(result, tokens=[[1]], accepted=[0])))
    leader = dict(wire.to_wire(Done(2, 4, LEADER))["result"], grammar_failures=["x"])
    with pytest.raises(ProtocolError, match="grammar_failures and tokens differ"):
        protocol.from_wire(done(leader))
    with pytest.raises(ProtocolError, match="done.result: expected a map"):
        protocol.from_wire(done([]))
