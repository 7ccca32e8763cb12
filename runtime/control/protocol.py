"""Control-plane messages: msgpack maps, one frozen dataclass per message, never pickle.

Every message is a map with a string "type" and the fields of its dataclass (the step commands
and their replies are in runtime.control.commands; how a class's fields become the check of
its map: runtime.control.wire). `decode` refuses anything that is not a small, shallow msgpack
map of plain values, then reads it as the record of its type; a message that fails raises
`ProtocolError`, which callers log and drop. `encode` sends a record (its fields checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from runtime.control import auth
from runtime.control.codecs import MAX_DEPTH, ProtocolError
from runtime.control.commands import RoundReply, StepAck
from runtime.control.wire import Message, from_wire, message, to_wire

__all__ = ["MAX_DEPTH", "Message", "ProtocolError", "decode", "encode", "from_wire"]  # + messages

# Decoding may cost many times a frame's size (an empty list is 1 byte of msgpack, ~64 bytes
# of Python): frames are capped at 16 MiB (millions of token ids) and the lists and maps of
# one message at MAX_CONTAINERS, so that one hostile frame costs at most a few hundred MB.
# Values of any shape nest MAX_DEPTH deep at most (runtime.control.codecs.check_shape).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_CONTAINERS = 100_000


# --- worker -> orchestrator ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerMessage(Message):
    """What a worker sends: every one names its rank."""

    rank: int


@message("hello")
@dataclass(frozen=True, slots=True)
class Hello(WorkerMessage):
    pid: int
    host: str


@message("ready")
@dataclass(frozen=True, slots=True)
class Ready(WorkerMessage):
    kv_blocks: int = 0  # the KV pool's blocks (the same on every rank)
    shares_blocks: bool = False  # every model of the rank reads through block tables


@message("progress")
@dataclass(frozen=True, slots=True)
class Progress(WorkerMessage):
    """While starting: phase "weights" (tensors) or "graphs" (CUDA graphs), summed over the
    rank's models; a few a second at most (runtime.control.progress)."""

    phase: str
    done: int
    total: int


@message("done")
@dataclass(frozen=True, slots=True)
class Done(WorkerMessage):
    """A step's reply record (runtime.control.commands)."""

    step: int
    result: RoundReply | StepAck


@message("error")
@dataclass(frozen=True, slots=True)
class Error(WorkerMessage):
    """kind "usage": the config asks for what the rank cannot do (a KV cache over its
    budget): rank 0 reports it as a usage error, not as a crash."""

    step: int
    message: str
    kind: str | None = None


@message("heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat(WorkerMessage):
    next_s: float | None = None  # when the next one comes


# --- orchestrator -> worker ----------------------------------------------------------------
@message("init")
@dataclass(frozen=True, slots=True)
class Init(Message):
    """heartbeat: the Beacon's address (beats to listen to); pulse: where to send
    heartbeats."""

    config: dict[str, Any]
    heartbeat: str
    pulse: str


@message("shutdown")
@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    pass


# --- client -> server ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClientRequest(Message):
    """What a client sends: every one names its request."""

    id: str


@message("generate")
@dataclass(frozen=True, slots=True)
class Generate(ClientRequest):
    """prompts (text) or prompt_ids (token id rows) or messages (one chat: OpenAI's
    messages, runtime.serving.chat); tools (OpenAI's function tools) go through the chat
    template with messages or chat prompts. What is in them the server checks (a bad one is
    answered `failed`)."""

    params: dict[str, Any]
    stream: bool
    prompts: list[Any] | None = None
    prompt_ids: list[Any] | None = None
    chat: bool = False
    messages: list[Any] | None = None
    tools: list[Any] | None = None


@message("cancel")
@dataclass(frozen=True, slots=True)
class Cancel(ClientRequest):
    pass


@message("ping")
@dataclass(frozen=True, slots=True)
class Ping(ClientRequest):
    pass


@message("stats")
@dataclass(frozen=True, slots=True)
class Stats(ClientRequest):
    pass


@message("metrics")
@dataclass(frozen=True, slots=True)
class Metrics(ClientRequest):
    """-> metrics_reply: the Prometheus text exposition."""


# --- server -> client ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClientReply(Message):
    """What the server sends a client: every one names the request it answers."""

    id: str


@message("delta")
@dataclass(frozen=True, slots=True)
class Delta(ClientReply):
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[Any] | None = None  # per token: [[id, logprob], ...], the chosen first


@message("final")
@dataclass(frozen=True, slots=True)
class Final(ClientReply):
    outputs: list[dict[str, Any]]  # runtime.serving.sequence.Sequence.output, per prompt


@message("failed")
@dataclass(frozen=True, slots=True)
class Failed(ClientReply):
    """kind: "value" (a bad request), "cancelled" (the client went silent, or asked),
    "draining" (a new request while the server drains: it takes none), "dead" (the engine
    failed, or the server is shutting down); `param`: for "value", the argument
    refused (runtime.errors.ArgumentError's), when one is."""

    message: str
    kind: str
    param: str | None = None


@message("pong")
@dataclass(frozen=True, slots=True)
class Pong(ClientReply):
    info: dict[str, Any]


@message("starting")
@dataclass(frozen=True, slots=True)
class Starting(ClientReply):
    """A ping's answer while the workers load."""


@message("stats_reply")
@dataclass(frozen=True, slots=True)
class StatsReply(ClientReply):
    stats: dict[str, Any]


@message("metrics_reply")
@dataclass(frozen=True, slots=True)
class MetricsReply(ClientReply):
    text: str


# --- frames --------------------------------------------------------------------------------
def encode(msg: Message, key: bytes | None = None) -> bytes:
    """msgpack bytes of a message (its fields checked), HMAC-signed when a key is given
    (runtime.control.auth)."""
    return auth.sign(msgpack.packb(to_wire(msg), use_bin_type=True), key)


def decode(frame: bytes, key: bytes | None = None) -> Message:
    """The checked message in `frame` (verifying its signature when a key is given)."""
    if key is not None:
        try:
            frame = auth.verify(frame, key)
        except auth.AuthError as exc:
            raise ProtocolError(str(exc)) from None
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        budget = _ContainerBudget()
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_buffer_size=MAX_MESSAGE_BYTES,
            ext_hook=_refuse_ext,
            list_hook=budget,
            object_hook=budget,
        )
        unpacker.feed(frame)
        wire = unpacker.unpack()
        if unpacker.tell() != len(frame):
            raise ProtocolError("trailing bytes after the message")
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    return from_wire(wire)


class _ContainerBudget:
    """list_hook/object_hook of the unpacker: stops decoding at MAX_CONTAINERS lists and maps
    (each is built before the hook sees it, so the cost stays bounded)."""

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def __call__(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"message holds more than {MAX_CONTAINERS} lists and maps")
        return value


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")
