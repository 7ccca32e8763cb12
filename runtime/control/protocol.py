"""Control-plane messages: msgpack maps with explicit schemas, never pickle.

Every message is a map with a string "type". `decode` refuses anything that is not a small,
shallow msgpack map of plain values, then checks it against the schema of its type; a message
that fails raises `ProtocolError`, which callers log and drop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    "heartbeat": {"rank": INT, "next_s": FLOAT},   # next_s: when the next one comes
    # orchestrator -> worker
    # heartbeat: the Beacon's address (beats to listen to); pulse: where to send heartbeats
    "init": {"config": MAP, "heartbeat": STR, "pulse": STR},
    # cached: per slot, the leading positions its table's blocks hold already (prefix hits);
    # tables: per slot, its KV blocks (runtime.serving.block_manager)
    "prefill": {"step": INT, "slots": LIST, "prompts": LIST, "params": LIST, "cached": LIST,
                "tables": LIST},
    # steps: k = 0 only; next_k: the next round's k, worked on ahead (runtime.worker.process)
    # (runtime.control.protocol.RoundCommand sends every field; steps defaults to 1, next_k
    # to k)
    # tables: per slot, the blocks its table grows by before the round
    "round": {"step": INT, "slots": LIST, "k": INT, "steps": INT, "next_k": INT,
              "tables": LIST},
    "release": {"step": INT, "slots": LIST},
    "shutdown": {},
    # client -> server
    "generate": {"id": STR, "prompts": LIST, "prompt_ids": LIST, "params": MAP, "stream": BOOL,
                 "chat": BOOL, "messages": LIST},   # messages: one chat, [{role, content}]
    "cancel": {"id": STR},
    "ping": {"id": STR},
    "stats": {"id": STR},
    "metrics": {"id": STR},          # -> metrics_reply: the Prometheus text exposition
    # server -> client
    "delta": {"id": STR, "index": INT, "token_ids": LIST, "text": STR},
    "final": {"id": STR, "outputs": LIST},
    "failed": {"id": STR, "message": STR, "kind": STR},
    "pong": {"id": STR, "info": MAP},
    "stats_reply": {"id": STR, "stats": MAP},
    "metrics_reply": {"id": STR, "text": STR},
}
OPTIONAL: dict[str, set[str]] = {
    "heartbeat": {"next_s"},
    "ready": {"kv_blocks", "shares_blocks"},
    "prefill": {"cached", "tables"},
    "generate": {"prompts", "prompt_ids", "chat", "messages"},
    "round": {"steps", "next_k", "tables"},
    "error": {"kind"},
}


class ProtocolError(ValueError):
    """A frame that is not a valid message: dropped and logged, never fatal."""


def encode(msg: dict, key: bytes | None = None) -> bytes:
    """msgpack bytes of a checked message, HMAC-signed when a key is given (runtime.control.auth)."""
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
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True,
                                    max_buffer_size=MAX_MESSAGE_BYTES, ext_hook=_refuse_ext,
                                    list_hook=budget, object_hook=budget)
        unpacker.feed(frame)
        msg = unpacker.unpack()
        if unpacker.tell() != len(frame):
            raise ProtocolError("trailing bytes after the message")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
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


def check_fields(kind: str, msg: dict, schema: dict[str, Any], optional: set[str] = frozenset(),
                 tag: str = "type") -> None:
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
            raise ProtocolError(f"{kind}.{field}: expected {_names(types)}, "
                                f"got {type(value).__name__}")
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
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"{name}: expected a list of integers")
    return value


def check_sampling(params) -> dict:
    """Per-request sampling settings from a prefill message (the orchestrator validated
    the request; this guards the worker against a malformed message)."""
    if not isinstance(params, dict):
        raise ProtocolError("prefill.params: expected maps")
    try:
        out = {"temperature": float(params["temperature"]), "top_k": int(params["top_k"] or 0),
               "top_p": float(params["top_p"]), "seed": int(params["seed"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"prefill.params: {exc}") from None
    if out["temperature"] < 0 or out["top_k"] < 0 or not 0 < out["top_p"] <= 1:
        raise ProtocolError(f"prefill.params out of range: {out}")
    return out


def check_prefill(msg: dict) -> tuple[list[list[int]], list[dict], list[int],
                                      list[list[int]]]:
    """(prompts, sampling params, cached positions, block tables) of a prefill message,
    one of each per slot (no tables: an empty list; no cached positions: zeros)."""
    prompts = [int_list(p, "prefill.prompts") for p in msg["prompts"]]
    params = [check_sampling(p) for p in msg["params"]]
    cached = int_list(msg.get("cached", [0] * len(prompts)), "prefill.cached")
    tables = [int_list(t, "prefill.tables") for t in msg.get("tables", [])]
    if not len(prompts) == len(params) == len(msg["slots"]) == len(cached):
        raise ProtocolError("prefill: slots, prompts, params, cached differ in length")
    if tables and len(tables) != len(prompts):
        raise ProtocolError("prefill: slots and tables differ in length")
    if any(not 0 <= c < len(p) for c, p in zip(cached, prompts)):
        raise ProtocolError("prefill.cached: each must be in 0..len(prompt) - 1")
    return prompts, params, cached, tables


# --- step commands and their replies, as typed records ------------------------------------
# A command is a message above (to_msg / from_msg); a reply is the `result` map of a "done"
# message, tagged "kind" with its schema here (to_map / from_map). Every field is always sent.
TARGET_LEADER = "target_leader"     # reports the round's verdict
WORKER = "worker"                   # any other rank: its time only
REPLIES: dict[str, dict[str, Any]] = {
    "ack": {},                      # a release done (a prefill replies as a round: first tokens)
    # cached: per slot, the positions every shard of the rank caches committed KV for
    "round": {"role": STR, "worker_s": FLOAT, "timing": MAP, "tokens": LIST, "accepted": LIST,
              "overlapped": LIST, "cached": LIST},
}


def _command(msg: dict, kind: str) -> dict:
    check(msg)
    if msg["type"] != kind:
        raise ProtocolError(f"expected a {kind} command, got {msg['type']!r}")
    return msg


@dataclass(frozen=True)
class RoundCommand:
    """orchestrator -> every worker: one round of `slots`. k drafts per slot (0: a
    target-only round of `steps` decode steps); next_k: the next round's k, announced so
    that the workers start on it ahead (runtime.worker.round.work_ahead)."""
    TYPE: ClassVar[str] = "round"
    slots: list[int]
    k: int
    next_k: int
    steps: int = 1
    tables: list[list[int]] = field(default_factory=list)   # per slot: blocks to append

    def to_msg(self) -> dict:
        return {"type": self.TYPE, "slots": list(self.slots), "k": self.k,
                "steps": self.steps, "next_k": self.next_k,
                "tables": [list(t) for t in self.tables]}

    @classmethod
    def from_msg(cls, msg: dict) -> RoundCommand:
        msg = _command(msg, cls.TYPE)
        slots = int_list(msg["slots"], "round.slots")
        tables = [int_list(t, "round.tables") for t in msg.get("tables", [])]
        if tables and len(tables) != len(slots):
            raise ProtocolError("round: slots and tables differ in length")
        return cls(slots, msg["k"], msg.get("next_k", msg["k"]), msg.get("steps", 1), tables)


@dataclass(frozen=True)
class PrefillCommand:
    """orchestrator -> every worker: start these slots' sequences (tokens so far, sampling),
    their first `cached` positions already in the blocks of their `tables` (prefix hits)."""
    TYPE: ClassVar[str] = "prefill"
    slots: list[int]
    prompts: list[list[int]]
    params: list[dict]
    cached: list[int] = field(default_factory=list)         # default: none cached
    tables: list[list[int]] = field(default_factory=list)   # default: none sent

    def __post_init__(self):
        if not self.cached:
            object.__setattr__(self, "cached", [0] * len(self.slots))

    def to_msg(self) -> dict:
        return {"type": self.TYPE, "slots": list(self.slots), "prompts": list(self.prompts),
                "params": list(self.params), "cached": list(self.cached),
                "tables": [list(t) for t in self.tables]}

    @classmethod
    def from_msg(cls, msg: dict) -> PrefillCommand:
        msg = _command(msg, cls.TYPE)
        prompts, params, cached, tables = check_prefill(msg)
        return cls(int_list(msg["slots"], "prefill.slots"), prompts, params, cached, tables)


@dataclass(frozen=True)
class ReleaseCommand:
    """orchestrator -> every worker: these slots' sequences are over."""
    TYPE: ClassVar[str] = "release"
    slots: list[int]

    def to_msg(self) -> dict:
        return {"type": self.TYPE, "slots": list(self.slots)}

    @classmethod
    def from_msg(cls, msg: dict) -> ReleaseCommand:
        return cls(int_list(_command(msg, cls.TYPE)["slots"], "release.slots"))


def command(msg: dict) -> RoundCommand | PrefillCommand | ReleaseCommand:
    """The typed step command in a message (ProtocolError for any other)."""
    kinds = {c.TYPE: c for c in (RoundCommand, PrefillCommand, ReleaseCommand)}
    kind = msg.get("type") if isinstance(msg, dict) else None
    if kind not in kinds:
        raise ProtocolError(f"not a step command: {kind!r}")
    return kinds[kind].from_msg(msg)


def _reply(result: Any, kind: str) -> dict:
    if not isinstance(result, dict) or result.get("kind") != kind:
        got = result.get("kind") if isinstance(result, dict) else type(result).__name__
        raise ProtocolError(f"expected a {kind} reply, got {got!r}")
    check_fields(f"{kind} reply", result, REPLIES[kind], tag="kind")
    return result


@dataclass(frozen=True)
class StepAck:
    """A worker's reply to a prefill or a release."""
    KIND: ClassVar[str] = "ack"

    def to_map(self) -> dict:
        return {"kind": self.KIND}

    @classmethod
    def from_map(cls, result: Any) -> StepAck:
        _reply(result, cls.KIND)
        return cls()


@dataclass(frozen=True)
class RoundReply:
    """A worker's reply to a round: its own time (and phases when profiling); from the
    target leader (role TARGET_LEADER) also the verdict per slot: the committed tokens, the
    drafts accepted, and (overlapped rounds) whether its window was drafted during the last
    verify. Other workers (role WORKER) send empty lists."""
    KIND: ClassVar[str] = "round"
    role: str
    worker_s: float
    timing: dict[str, float] = field(default_factory=dict)
    tokens: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    overlapped: list[bool] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)   # per slot (every rank reports it)

    @property
    def reports(self) -> bool:
        return self.role == TARGET_LEADER

    def to_map(self) -> dict:
        return {"kind": self.KIND, "role": self.role, "worker_s": float(self.worker_s),
                "timing": dict(self.timing), "tokens": [list(t) for t in self.tokens],
                "accepted": list(self.accepted), "overlapped": list(self.overlapped),
                "cached": list(self.cached)}

    @classmethod
    def from_map(cls, result: Any) -> RoundReply:
        m = _reply(result, cls.KIND)
        if m["role"] not in (TARGET_LEADER, WORKER):
            raise ProtocolError(f"round reply: unknown role {m['role']!r}")
        tokens = [int_list(t, "round reply.tokens") for t in m["tokens"]]
        accepted = int_list(m["accepted"], "round reply.accepted")
        overlapped = m["overlapped"]
        if not all(isinstance(v, bool) for v in overlapped):
            raise ProtocolError("round reply.overlapped: expected a list of booleans")
        if not all(isinstance(k, str) and isinstance(v, FLOAT) and not isinstance(v, bool)
                   for k, v in m["timing"].items()):
            raise ProtocolError("round reply.timing: expected phase -> seconds")
        if len(tokens) != len(accepted) or overlapped and len(overlapped) != len(tokens):
            raise ProtocolError("round reply: tokens, accepted, overlapped differ in length")
        if m["role"] == WORKER and tokens:
            raise ProtocolError("round reply: only the target leader reports tokens")
        cached = int_list(m["cached"], "round reply.cached")
        return cls(m["role"], float(m["worker_s"]), dict(m["timing"]), tokens, accepted,
                   list(overlapped), cached)
