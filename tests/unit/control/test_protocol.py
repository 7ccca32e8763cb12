"""The control plane's frames (runtime.control.protocol) and the schemas derived from the
message dataclasses (runtime.control.wire): the wire is what it was with hand-written
schemas, and everything that is no valid message is a ProtocolError."""

import dataclasses
from typing import Any

import msgpack
import pytest

from runtime.control import commands, protocol, wire
from runtime.control.commands import RoundCommand, Sampling

pytestmark = pytest.mark.timeout(30)

# type -> (required fields, optional fields): the wire as runtime.control.protocol's SCHEMAS
# and OPTIONAL tables had it before the schemas were derived from the dataclasses
WIRE = {
    "hello": ({"rank", "pid", "host"}, set()),
    "ready": ({"rank"}, {"kv_blocks", "shares_blocks"}),
    "progress": ({"rank", "phase", "done", "total"}, set()),
    "done": ({"rank", "step", "result"}, set()),
    "error": ({"rank", "step", "message"}, {"kind"}),
    "heartbeat": ({"rank"}, {"next_s"}),
    "init": ({"config", "heartbeat", "pulse"}, set()),
    "prefill": ({"step", "slots", "prompts", "params"}, {"cached", "tables", "final"}),
    "round": ({"step", "slots", "k"}, {"steps", "next_k", "tables"}),
    "release": ({"step", "slots"}, set()),
    "draft_cross": ({"step", "slots", "k", "keep", "tokens", "params"}, set()),
    "verify_cross": ({"step", "slots", "proposals", "tables"}, set()),
    "shutdown": (set(), set()),
    "generate": (
        {"id", "params", "stream"},
        {"prompts", "prompt_ids", "chat", "messages", "tools"},
    ),
    "cancel": ({"id"}, set()),
    "ping": ({"id"}, set()),
    "stats": ({"id"}, set()),
    "metrics": ({"id"}, set()),
    "delta": ({"id", "index", "token_ids", "text"}, {"logprobs"}),
    "final": ({"id", "outputs"}, set()),
    "failed": ({"id", "message", "kind"}, {"param"}),  # param: the argument refused
    "pong": ({"id", "info"}, set()),
    "starting": ({"id"}, set()),
    "stats_reply": ({"id", "stats"}, set()),
    "metrics_reply": ({"id", "text"}, set()),
}
SAMPLING_EXTRAS = {  # the processors and logprobs: a map may leave them out (off)
    "min_p", "bias_ids", "bias_values", "min_tokens", "stop_ids", "output_start", "repetition",
    "frequency", "presence", "prompt", "output", "logprobs", "prompt_logprobs",
    "grammar_kind", "grammar_text", "grammar_wire", "grammar_vocab",
}  # fmt: skip
REPLY_FIELDS = {"role", "worker_s", "timing", "tokens", "accepted", "overlapped", "cached"}


def fields(schema: wire.Schema) -> tuple[set[str], set[str]]:
    return (
        {f.name for f in schema.fields if not f.optional},
        {f.name for f in schema.fields if f.optional},
    )


def test_the_derived_schemas_are_the_wire_as_it_was():
    assert {name: fields(cls._schema) for name, cls in wire.MESSAGES.items()} == WIRE
    assert fields(commands.RoundReply._schema) == (
        REPLY_FIELDS,
        {"logprobs", "prompt_logprobs", "grammar_failures"},
    )
    assert fields(commands.StepAck._schema) == (set(), set())
    assert fields(Sampling._schema) == ({"temperature", "top_k", "top_p", "seed"}, SAMPLING_EXTRAS)


def test_round_trip():
    cmd = RoundCommand([0, 2], 4, step=3)
    assert wire.to_wire(cmd) == {
        "type": "round",
        "step": 3,
        "slots": [0, 2],
        "k": 4,
        "next_k": 4,
        "steps": 1,
        "tables": [],
    }
    assert protocol.decode(protocol.encode(cmd)) == cmd
    short = msgpack.packb({"type": "round", "step": 3, "slots": [0, 2], "k": 4})
    assert protocol.decode(short) == cmd


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"type": "nope"}),  # unknown type
        msgpack.packb({"type": ["round"]}),  # a type that is no string
        msgpack.packb({"type": "round", "step": 1, "slots": []}),  # missing field
        msgpack.packb({"type": "round", "step": "1", "slots": [], "k": 1}),  # wrong type
        msgpack.packb({"type": "round", "step": True, "slots": [], "k": 1}),  # bool is no int
        msgpack.packb({"type": "shutdown", "extra": 1}),  # unknown field
        msgpack.packb({"type": "error", "rank": 1, "step": 1, "message": "x", "kind": None}),
        msgpack.packb({"type": "generate", "id": "g", "params": {}, "stream": True, 1: 2}),
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb(msgpack.ExtType(1, b"x")),  # extension type
        b"\x80\x03cbuiltins\nexec\n.",  # a pickle
    ],
)
def test_bad_frames_are_protocol_errors(frame):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(frame)


def test_deep_nesting_refused():
    value: Any = []
    for _ in range(50):
        value = [value]
    frame = msgpack.packb({"type": "init", "config": {"x": value}, "heartbeat": "", "pulse": ""})
    with pytest.raises(protocol.ProtocolError, match="nested"):
        protocol.decode(frame)
    frame = msgpack.packb({"type": "release", "step": 1, "slots": value})  # typed: no walk
    with pytest.raises(protocol.ProtocolError, match="release.slots"):
        protocol.decode(frame)
    with pytest.raises(protocol.ProtocolError, match="map keys"):
        protocol.encode(protocol.Init({"x": {1: 2}}, "", ""))


def test_huge_declared_length_refused():
    frame = b"\xdb\xff\xff\xff\xff" + b"x" * 10  # str32 claiming 4 GiB
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(frame)


def test_none_is_never_on_the_wire():
    """An optional field X | None = None is left out when None, and refused as a value."""
    assert "kind" not in wire.to_wire(protocol.Error(1, 2, "boom"))
    assert wire.to_wire(protocol.Error(1, 2, "boom", kind="usage"))["kind"] == "usage"
    sent = wire.to_wire(protocol.Generate("g", {}, False, prompt_ids=[[1]]))
    assert "prompts" not in sent and "messages" not in sent and sent["chat"] is False
    with pytest.raises(protocol.ProtocolError, match="generate.prompts"):
        protocol.from_wire(dict(sent, prompts=None))


def test_encode_checks_the_fields():
    with pytest.raises(protocol.ProtocolError, match="round.slots"):
        protocol.encode(RoundCommand([0, True], 4))  # type: ignore[list-item]
    with pytest.raises(protocol.ProtocolError, match="done.result"):
        protocol.encode(protocol.Done(1, 1, {"kind": "ack"}))  # type: ignore[arg-type]
    with pytest.raises(protocol.ProtocolError, match="not a message"):
        protocol.encode({"type": "shutdown"})  # type: ignore[arg-type]


def test_every_message_type_once():
    names = [cls.NAME for cls in wire.MESSAGES.values()]
    assert len(names) == len(set(names)) == len(WIRE)
    with pytest.raises(TypeError, match="two messages"):

        @wire.message("ping")
        @dataclasses.dataclass(frozen=True)
        class Again(wire.Message):
            id: str


def test_sampling_guards_prefill_params():
    ok = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}
    assert Sampling.of(ok) == Sampling(0.7, 0, 0.9, 3)
    assert Sampling.of(dict(ok, temperature=1)) == Sampling(1.0, 0, 0.9, 3)  # an int: a float
    for bad, match in (
        ({"temperature": 1.0}, "missing field"),
        (dict(ok, top_k=None), "params.top_k"),
        (dict(ok, seed="3"), "params.seed"),
        (dict(ok, extra=1), "unknown fields"),
        (dict(ok, top_p=0.0), "out of range"),
        (dict(ok, temperature=-1), "out of range"),
    ):
        with pytest.raises(protocol.ProtocolError, match=match):
            Sampling.of(bad)
    prefill = commands.PrefillCommand([0], [[1, 2]], [Sampling.of(ok)])
    sent = protocol.decode(protocol.encode(prefill))  # records on the wire, records back
    assert isinstance(sent, commands.PrefillCommand) and sent.params == [Sampling(0.7, 0, 0.9, 3)]
