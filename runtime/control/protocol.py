"""Control-plane messages: msgpack maps with explicit schemas, never pickle.

Every message is a map with a string "type". `decode` refuses anything that is not a small,
shallow msgpack map of plain values, then checks it against the schema of its type; a message
that fails raises `ProtocolError`, which callers log and drop.
"""

from __future__ import annotations

from typing import Any

import msgpack

from runtime.control import auth

# Decoding may cost many times a frame's size (an empty list is 1 byte of msgpack, ~64 bytes
# of Python): frames are capped at 16 MiB (millions of token ids) and the lists and maps of
# one message at MAX_CONTAINERS, so that one hostile frame costs at most a few hundred MB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 8
MAX_CONTAINERS = 100_000

INT = int
FLOAT = (int, float)
STR = str
BOOL = bool
LIST = list
MAP = dict
OPT_STR = (str, type(None))
OPT_INT = (int, type(None))
OPT_FLOAT = (int, float, type(None))

# type -> {field: allowed python types}; every field is required unless listed in OPTIONAL.
SCHEMAS: dict[str, dict[str, Any]] = {
    # worker -> orchestrator
    "hello": {"rank": INT, "pid": INT, "host": STR},
    # kv_blocks: the KV pool's blocks (the same on every rank); shares_blocks: whether every
    # model of the rank reads through block tables (prefix caching needs that)
    "ready": {"rank": INT, "kv_blocks": INT, "shares_blocks": BOOL},
    # while starting: phase "weights" (tensors) or "graphs" (CUDA graphs), summed over the
    # rank's models; a few a second at most (runtime.control.progress)
    "progress": {"rank": INT, "phase": STR, "done": INT, "total": INT},
    # result: the step's reply record, a map tagged "kind" (REPLIES: StepAck, RoundReply),
    # checked against its schema where it is read
    "done": {"rank": INT, "step": INT, "result": MAP},
    # kind "usage": the config asks for what the rank cannot do (a KV cache over its
    # budget): rank 0 reports it as a usage error, not as a crash
    "error": {"rank": INT, "step": INT, "message": STR, "kind": STR},
    "heartbeat": {"rank": INT, "next_s": FLOAT},  # next_s: when the next one comes
    # orchestrator -> worker
    # heartbeat: the Beacon's address (beats to listen to); pulse: where to send heartbeats
    "init": {"config": MAP, "heartbeat": STR, "pulse": STR},
    # prompts: per slot, its tokens from position cached[i] on (the positions before are in
    # its table's blocks already: prefix hits, earlier chunks); tables: per slot, its KV
    # blocks (runtime.serving.block_manager); final: per slot, whether these tokens end its
    # prompt (the target then picks its first token) or a chunk of it (the last stays pending)
    "prefill": {
        "step": INT,
        "slots": LIST,
        "prompts": LIST,
        "params": LIST,
        "cached": LIST,
        "tables": LIST,
        "final": LIST,
    },
    # steps: k = 0 only; next_k: the next round's k, worked on ahead (runtime.worker.process)
    # (runtime.control.commands.RoundCommand sends every field; steps defaults to 1, next_k
    # to k)
    # tables: per slot, the blocks its table grows by before the round
    "round": {"step": INT, "slots": LIST, "k": INT, "steps": INT, "next_k": INT, "tables": LIST},
    "release": {"step": INT, "slots": LIST},
    # a draft with another tokenizer (runtime.serving.cross_round): the draft's committed
    # tokens become keep cached ones and `tokens`, then it proposes k (its own ids) ...
    "draft_cross": {
        "step": INT,
        "slots": LIST,
        "k": INT,
        "keep": LIST,
        "tokens": LIST,
        "params": LIST,
    },
    # ... which rank 0 maps to the target's ids: the target verifies and commits them
    "verify_cross": {"step": INT, "slots": LIST, "proposals": LIST, "tables": LIST},
    "shutdown": {},
    # client -> server
    "generate": {
        "id": STR,
        "prompts": LIST,
        "prompt_ids": LIST,
        "params": MAP,
        "stream": BOOL,
        "chat": BOOL,
        "messages": LIST,
    },  # messages: one chat, [{role, content}]
    "cancel": {"id": STR},
    "ping": {"id": STR},
    "stats": {"id": STR},
    "metrics": {"id": STR},  # -> metrics_reply: the Prometheus text exposition
    # server -> client
    "delta": {"id": STR, "index": INT, "token_ids": LIST, "text": STR},
    "final": {"id": STR, "outputs": LIST},
    # kind: "value" (a bad request), "cancelled" (the client went silent, or asked),
    # "dead" (the engine failed, or the server is shutting down)
    "failed": {"id": STR, "message": STR, "kind": STR},
    "pong": {"id": STR, "info": MAP},
    "starting": {"id": STR},  # a ping's answer while the workers load
    "stats_reply": {"id": STR, "stats": MAP},
    "metrics_reply": {"id": STR, "text": STR},
}
OPTIONAL: dict[str, set[str]] = {
    "heartbeat": {"next_s"},
    "ready": {"kv_blocks", "shares_blocks"},
    "prefill": {"cached", "tables", "final"},
    "generate": {"prompts", "prompt_ids", "chat", "messages"},
    "round": {"steps", "next_k", "tables"},
    "error": {"kind"},
}


class ProtocolError(ValueError):
    """A frame that is not a valid message: dropped and logged, never fatal."""


def encode(msg: dict, key: bytes | None = None) -> bytes:
    """msgpack bytes of a checked message, HMAC-signed when a key is given
    (runtime.control.auth)."""
    check(msg)
    return auth.sign(msgpack.packb(msg, use_bin_type=True), key)


def decode(frame: bytes, key: bytes | None = None) -> dict:
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
        msg = unpacker.unpack()
        if unpacker.tell() != len(frame):
            raise ProtocolError("trailing bytes after the message")
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    check(msg)
    return msg


def check(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, not a map")
    _check_depth(msg, 0)
    kind = msg.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    check_fields(kind, msg, schema, OPTIONAL.get(kind, set()), "type")


def check_fields(
    kind: str,
    msg: dict,
    schema: dict[str, Any],
    optional: set[str] = frozenset(),
    tag: str = "type",
) -> None:
    """Every field of `schema` present (unless optional) with an allowed type, none other
    than `tag` (the field naming the record's kind)."""
    for field, types in schema.items():
        if field not in msg:
            if field in optional:
                continue
            raise ProtocolError(f"{kind}: missing field {field!r}")
        value = msg[field]
        if isinstance(value, bool) and types is not BOOL and bool not in _as_tuple(types):
            raise ProtocolError(f"{kind}.{field}: expected {_names(types)}, got bool")
        if not isinstance(value, types):
            raise ProtocolError(
                f"{kind}.{field}: expected {_names(types)}, got {type(value).__name__}"
            )
    extra = set(msg) - set(schema) - {tag}
    if extra:
        raise ProtocolError(f"{kind}: unknown fields {sorted(extra)}")


class _ContainerBudget:
    """list_hook/object_hook of the unpacker: stops decoding at MAX_CONTAINERS lists and maps
    (each is built before the hook sees it, so the cost stays bounded)."""

    def __init__(self):
        self.left = MAX_CONTAINERS

    def __call__(self, value):
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"message holds more than {MAX_CONTAINERS} lists and maps")
        return value


def _refuse_ext(code: int, data: bytes):
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _check_depth(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"message nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError("map keys must be strings")
            _check_depth(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                _check_depth(item, depth + 1)


def _as_tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _names(types) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))


def int_list(value: Any, name: str) -> list[int]:
    """A list of ints (not bools) or ProtocolError naming the field."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ProtocolError(f"{name}: expected a list of integers")
    return value
