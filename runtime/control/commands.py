"""Step commands (orchestrator -> every worker: prefill, round, release) and the workers'
replies as typed records over the control plane's messages (runtime.control.protocol): a
command is a message (to_msg / from_msg), a reply the `result` map of a "done" message, tagged
"kind" with its schema here (to_map / from_map). Every field is always sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from runtime.control.protocol import (
    FLOAT,
    LIST,
    MAP,
    STR,
    ProtocolError,
    check,
    check_fields,
    int_list,
)


def check_sampling(params) -> dict:
    """Per-request sampling settings from a prefill message (the orchestrator validated
    the request; this guards the worker against a malformed message)."""
    if not isinstance(params, dict):
        raise ProtocolError("prefill.params: expected maps")
    try:
        out = {
            "temperature": float(params["temperature"]),
            "top_k": int(params["top_k"] or 0),
            "top_p": float(params["top_p"]),
            "seed": int(params["seed"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"prefill.params: {exc}") from None
    if out["temperature"] < 0 or out["top_k"] < 0 or not 0 < out["top_p"] <= 1:
        raise ProtocolError(f"prefill.params out of range: {out}")
    return out


def check_prefill(
    msg: dict,
) -> tuple[list[list[int]], list[dict], list[int], list[list[int]], list[bool]]:
    """(tokens, sampling params, cached positions, block tables, final) of a prefill message,
    one of each per slot (no tables: an empty list; no cached positions: zeros; no final:
    all final)."""
    prompts = [int_list(p, "prefill.prompts") for p in msg["prompts"]]
    params = [check_sampling(p) for p in msg["params"]]
    cached = int_list(msg.get("cached", [0] * len(prompts)), "prefill.cached")
    tables = [int_list(t, "prefill.tables") for t in msg.get("tables", [])]
    final = msg.get("final", [True] * len(prompts))
    if not all(isinstance(f, bool) for f in final):
        raise ProtocolError("prefill.final: expected a list of booleans")
    if not len(prompts) == len(params) == len(msg["slots"]) == len(cached) == len(final):
        raise ProtocolError("prefill: slots, prompts, params, cached, final differ in length")
    if tables and len(tables) != len(prompts):
        raise ProtocolError("prefill: slots and tables differ in length")
    if any(c < 0 for c in cached) or any(
        not p or (not f and len(p) < 2) for p, f in zip(prompts, final)
    ):
        raise ProtocolError(
            "prefill.cached must be >= 0 and each slot's tokens non-empty (a chunk: at least 2)"
        )
    return prompts, params, cached, tables, final


TARGET_LEADER = "target_leader"  # reports the round's verdict
WORKER = "worker"  # any other rank: its time only
DRAFT_LEADER = "draft_leader"  # reports a cross-tokenizer draft's proposals
REPLIES: dict[str, dict[str, Any]] = {
    "ack": {},  # a release done (a prefill replies as a round: first tokens)
    # cached: per slot, the positions every shard of the rank caches committed KV for
    "round": {
        "role": STR,
        "worker_s": FLOAT,
        "timing": MAP,
        "tokens": LIST,
        "accepted": LIST,
        "overlapped": LIST,
        "cached": LIST,
    },
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
    tables: list[list[int]] = field(default_factory=list)  # per slot: blocks to append

    def to_msg(self) -> dict:
        return {
            "type": self.TYPE,
            "slots": list(self.slots),
            "k": self.k,
            "steps": self.steps,
            "next_k": self.next_k,
            "tables": [list(t) for t in self.tables],
        }

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
    """orchestrator -> every worker: these slots' sequences (re)start or go on: `prompts`
    holds each one's tokens from position `cached` on (the positions before are in the
    blocks of its table: prefix hits, earlier chunks), `final` whether they end its prompt
    (the target then picks its first output token) or are a chunk of it."""

    TYPE: ClassVar[str] = "prefill"
    slots: list[int]
    prompts: list[list[int]]
    params: list[dict]
    cached: list[int] = field(default_factory=list)  # default: none cached
    tables: list[list[int]] = field(default_factory=list)  # default: none sent
    final: list[bool] = field(default_factory=list)  # default: all final

    def __post_init__(self):
        if not self.cached:
            object.__setattr__(self, "cached", [0] * len(self.slots))
        if not self.final:
            object.__setattr__(self, "final", [True] * len(self.slots))

    def to_msg(self) -> dict:
        return {
            "type": self.TYPE,
            "slots": list(self.slots),
            "prompts": list(self.prompts),
            "params": list(self.params),
            "cached": list(self.cached),
            "tables": [list(t) for t in self.tables],
            "final": list(self.final),
        }

    @classmethod
    def from_msg(cls, msg: dict) -> PrefillCommand:
        msg = _command(msg, cls.TYPE)
        prompts, params, cached, tables, final = check_prefill(msg)
        return cls(int_list(msg["slots"], "prefill.slots"), prompts, params, cached, tables, final)


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


@dataclass(frozen=True)
class CrossDraftCommand:
    """orchestrator -> every worker, a draft with another tokenizer: per slot, the draft's
    committed sequence becomes its first keep[i] cached tokens and tokens[i] (its own ids,
    re-tokenised from the committed text; keep 0: a new sequence, sampled with params[i]);
    then it proposes k tokens, which its leader reports (runtime.serving.cross_round)."""

    TYPE: ClassVar[str] = "draft_cross"
    slots: list[int]
    k: int
    keep: list[int]
    tokens: list[list[int]]
    params: list[dict]

    def to_msg(self) -> dict:
        return {
            "type": self.TYPE,
            "slots": list(self.slots),
            "k": self.k,
            "keep": list(self.keep),
            "tokens": [list(t) for t in self.tokens],
            "params": list(self.params),
        }

    @classmethod
    def from_msg(cls, msg: dict) -> CrossDraftCommand:
        msg = _command(msg, cls.TYPE)
        slots = int_list(msg["slots"], "draft_cross.slots")
        keep = int_list(msg["keep"], "draft_cross.keep")
        tokens = [int_list(t, "draft_cross.tokens") for t in msg["tokens"]]
        params = [check_sampling(p) for p in msg["params"]]
        if not len(slots) == len(keep) == len(tokens) == len(params):
            raise ProtocolError("draft_cross: slots, keep, tokens, params differ in length")
        if any(not t for t in tokens) or any(n < 0 for n in keep):
            raise ProtocolError("draft_cross: a slot with no tokens or keep < 0")
        return cls(slots, msg["k"], keep, tokens, params)


@dataclass(frozen=True)
class CrossVerifyCommand:
    """orchestrator -> every worker, a draft with another tokenizer: the target verifies
    `proposals` (its own ids, any number per slot) under `tokens` acceptance and commits."""

    TYPE: ClassVar[str] = "verify_cross"
    slots: list[int]
    proposals: list[list[int]]
    tables: list[list[int]] = field(default_factory=list)  # per slot: blocks to append

    def to_msg(self) -> dict:
        return {
            "type": self.TYPE,
            "slots": list(self.slots),
            "proposals": [list(p) for p in self.proposals],
            "tables": [list(t) for t in self.tables],
        }

    @classmethod
    def from_msg(cls, msg: dict) -> CrossVerifyCommand:
        msg = _command(msg, cls.TYPE)
        slots = int_list(msg["slots"], "verify_cross.slots")
        proposals = [int_list(p, "verify_cross.proposals") for p in msg["proposals"]]
        tables = [int_list(t, "verify_cross.tables") for t in msg["tables"]]
        if len(proposals) != len(slots) or tables and len(tables) != len(slots):
            raise ProtocolError("verify_cross: slots, proposals, tables differ in length")
        return cls(slots, proposals, tables)


def command(
    msg: dict,
) -> RoundCommand | PrefillCommand | ReleaseCommand | CrossDraftCommand | CrossVerifyCommand:
    """The typed step command in a message (ProtocolError for any other)."""
    kinds = {
        c.TYPE: c
        for c in (
            RoundCommand,
            PrefillCommand,
            ReleaseCommand,
            CrossDraftCommand,
            CrossVerifyCommand,
        )
    }
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
    cached: list[int] = field(default_factory=list)  # per slot (every rank reports it)

    @property
    def reports(self) -> bool:
        return self.role in (TARGET_LEADER, DRAFT_LEADER)

    def to_map(self) -> dict:
        return {
            "kind": self.KIND,
            "role": self.role,
            "worker_s": float(self.worker_s),
            "timing": dict(self.timing),
            "tokens": [list(t) for t in self.tokens],
            "accepted": list(self.accepted),
            "overlapped": list(self.overlapped),
            "cached": list(self.cached),
        }

    @classmethod
    def from_map(cls, result: Any) -> RoundReply:
        m = _reply(result, cls.KIND)
        if m["role"] not in (TARGET_LEADER, DRAFT_LEADER, WORKER):
            raise ProtocolError(f"round reply: unknown role {m['role']!r}")
        tokens = [int_list(t, "round reply.tokens") for t in m["tokens"]]
        accepted = int_list(m["accepted"], "round reply.accepted")
        overlapped = m["overlapped"]
        if not all(isinstance(v, bool) for v in overlapped):
            raise ProtocolError("round reply.overlapped: expected a list of booleans")
        if not all(
            isinstance(k, str) and isinstance(v, FLOAT) and not isinstance(v, bool)
            for k, v in m["timing"].items()
        ):
            raise ProtocolError("round reply.timing: expected phase -> seconds")
        if len(tokens) != len(accepted) or overlapped and len(overlapped) != len(tokens):
            raise ProtocolError("round reply: tokens, accepted, overlapped differ in length")
        if m["role"] == WORKER and tokens:
            raise ProtocolError("round reply: only the target leader reports tokens")
        cached = int_list(m["cached"], "round reply.cached")
        return cls(
            m["role"],
            float(m["worker_s"]),
            dict(m["timing"]),
            tokens,
            accepted,
            list(overlapped),
            cached,
        )
