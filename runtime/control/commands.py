"""Step commands (orchestrator -> every worker: prefill, round, release, and a draft with
another tokenizer's draft_cross and verify_cross) and the workers' replies (the `result` of a
done message, tagged "kind"): one dataclass each, whose fields are its wire form
(runtime.control.wire derives the check). WorkerPool.command stamps each command's `step`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.control.codecs import ProtocolError
from runtime.control.wire import REQUIRED, Message, Record, message, record, tagged

TARGET_LEADER = "target_leader"  # reports the round's verdict
WORKER = "worker"  # any other rank: its time only
DRAFT_LEADER = "draft_leader"  # reports a cross-tokenizer draft's proposals
SAME_K = -1  # RoundCommand.next_k left out: the next round's k is this one's


@record("params")
@dataclass(frozen=True, slots=True)
class Sampling(Record):
    """One request's sampling settings as the workers use them (runtime.speculation.choose);
    rank 0 validated the request, this guards the workers against a malformed command."""

    temperature: float  # 0: greedy
    top_k: int  # 0: off
    top_p: float  # 1: off
    seed: int
    min_p: float = 0.0  # 0: off
    bias_ids: list[int] = field(default_factory=list)  # logit_bias: these token ids ...
    bias_values: list[float] = field(default_factory=list)  # ... get these added
    min_tokens: int = 0  # stop_ids are masked until this many tokens were generated
    stop_ids: list[int] = field(default_factory=list)  # EOS and stop_token_ids
    output_start: int = 0  # sequence index of the first generated token (the prompt's length)
    repetition: float = 1.0  # repetition_penalty over prompt and output tokens, 1: off
    frequency: float = 0.0  # frequency_penalty over output tokens, 0: off
    presence: float = 0.0  # presence_penalty over output tokens, 0: off
    prompt: list[int] = field(default_factory=list)  # the prompt, when a penalty reads it
    output: list[int] = field(default_factory=list)  # generated before this (re)start, ditto
    logprobs: int = -1  # top alternatives per generated token to report, -1: none
    prompt_logprobs: int = -1  # ... per prompt token (its prefill reports them), -1: none
    # structured outputs: the grammar's kind and text (checked by rank 0 to compile within
    # its bounds: runtime.speculation.grammar.compiler), and its compiled form (base64 of the
    # wire form) when compiling it takes long; "" kind: none
    grammar_kind: str = ""
    grammar_text: str = ""
    grammar_wire: str = ""
    grammar_vocab: str = ""  # the vocabulary grammars need, sent until the workers have it

    def check(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ProtocolError(f"params out of range: {self}")
        if (
            not 0 <= self.min_p <= 1
            or self.repetition <= 0
            or min(self.logprobs, self.prompt_logprobs) < -1
        ):
            raise ProtocolError(f"params out of range: {self}")
        if len(self.bias_ids) != len(self.bias_values) or self.min_tokens < 0:
            raise ProtocolError(
                f"params: {len(self.bias_ids)} bias ids, {len(self.bias_values)} values"
            )

    @property
    def penalised(self) -> bool:
        """Whether a penalty looks at the tokens so far (the shard keeps their history)."""
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @classmethod
    def of(cls, value: Sampling | Mapping[str, Any]) -> Sampling:
        """`value`, or the checked settings of a map (rank 0's Sequence.worker_params)."""
        if isinstance(value, Sampling):
            return value
        return cls._schema.load(dict(value), "params")


GREEDY = Sampling(0.0, 0, 1.0, 0)


@dataclass(frozen=True, slots=True)
class StepCommand(Message):
    """orchestrator -> every worker: one step, numbered by the pool (WorkerPool.command)."""

    step: int = field(default=0, kw_only=True, metadata=REQUIRED)


@message("round")
@dataclass(frozen=True, slots=True)
class RoundCommand(StepCommand):
    """One round of `slots`. k drafts per slot (0: a target-only round of `steps` decode
    steps); next_k: the next round's k, announced so that the workers start on it ahead
    (runtime.worker.round.work_ahead)."""

    slots: list[int]
    k: int
    next_k: int = SAME_K
    steps: int = 1
    tables: list[list[int]] = field(default_factory=list)  # per slot: blocks to append

    def __post_init__(self) -> None:
        if self.next_k == SAME_K:
            object.__setattr__(self, "next_k", self.k)

    def check(self) -> None:
        if self.tables and len(self.tables) != len(self.slots):
            raise ProtocolError("round: slots and tables differ in length")


@message("prefill")
@dataclass(frozen=True, slots=True)
class PrefillCommand(StepCommand):
    """These slots' sequences (re)start or go on: `prompts` holds each one's tokens from
    position `cached` on (the positions before are in the blocks of its table: prefix hits,
    earlier chunks), `final` whether they end its prompt (the target then picks its first
    output token) or are a chunk of it (the last token stays pending)."""

    slots: list[int]
    prompts: list[list[int]]
    params: list[Sampling]
    cached: list[int] = field(default_factory=list)  # default: none cached
    tables: list[list[int]] = field(default_factory=list)  # default: none sent
    final: list[bool] = field(default_factory=list)  # default: all final

    def __post_init__(self) -> None:
        if not self.cached:
            object.__setattr__(self, "cached", [0] * len(self.slots))
        if not self.final:
            object.__setattr__(self, "final", [True] * len(self.slots))

    def check(self) -> None:
        n = len(self.slots)
        if not len(self.prompts) == len(self.params) == len(self.cached) == len(self.final) == n:
            raise ProtocolError("prefill: slots, prompts, params, cached, final differ in length")
        if self.tables and len(self.tables) != n:
            raise ProtocolError("prefill: slots and tables differ in length")
        if any(c < 0 for c in self.cached) or any(
            not p or (not f and len(p) < 2) for p, f in zip(self.prompts, self.final)
        ):
            raise ProtocolError(
                "prefill.cached must be >= 0 and each slot's tokens non-empty (a chunk: at least 2)"
            )


@message("release")
@dataclass(frozen=True, slots=True)
class ReleaseCommand(StepCommand):
    """These slots' sequences are over."""

    slots: list[int]


@message("draft_cross")
@dataclass(frozen=True, slots=True)
class CrossDraftCommand(StepCommand):
    """A draft with another tokenizer: per slot, the draft's committed sequence becomes its
    first keep[i] cached tokens and tokens[i] (its own ids, re-tokenised from the committed
    text; keep 0: a new sequence, sampled with params[i]); then it proposes k tokens, which
    its leader reports (runtime.serving.cross_round)."""

    slots: list[int]
    k: int
    keep: list[int]
    tokens: list[list[int]]
    params: list[Sampling]

    def check(self) -> None:
        if not len(self.slots) == len(self.keep) == len(self.tokens) == len(self.params):
            raise ProtocolError("draft_cross: slots, keep, tokens, params differ in length")
        if any(not t for t in self.tokens) or any(n < 0 for n in self.keep):
            raise ProtocolError("draft_cross: a slot with no tokens or keep < 0")


@message("verify_cross")
@dataclass(frozen=True, slots=True)
class CrossVerifyCommand(StepCommand):
    """A draft with another tokenizer: the target verifies `proposals` (its own ids, any
    number per slot) under `tokens` acceptance and commits."""

    slots: list[int]
    proposals: list[list[int]]
    tables: list[list[int]] = field(
        default_factory=list, metadata=REQUIRED
    )  # per slot: blocks to append

    def check(self) -> None:
        if len(self.proposals) != len(self.slots) or (
            self.tables and len(self.tables) != len(self.slots)
        ):
            raise ProtocolError("verify_cross: slots, proposals, tables differ in length")


Command = RoundCommand | PrefillCommand | ReleaseCommand | CrossDraftCommand | CrossVerifyCommand


@tagged("ack")
@dataclass(frozen=True, slots=True)
class StepAck(Record):
    """A worker's reply to a release."""


@tagged("round")
@dataclass(frozen=True, slots=True)
class RoundReply(Record):
    """A worker's reply to a round or a prefill: its own time (and phases when profiling);
    from the target leader (role TARGET_LEADER; a cross draft's leader: DRAFT_LEADER) also the
    verdict per slot: the committed tokens, the drafts accepted, and (overlapped rounds)
    whether its window was drafted during the last verify. Other workers (role WORKER) send
    empty lists. Every field is sent."""

    role: str
    worker_s: float
    timing: dict[str, float] = field(default_factory=dict, metadata=REQUIRED)
    tokens: list[list[int]] = field(default_factory=list, metadata=REQUIRED)
    accepted: list[int] = field(default_factory=list, metadata=REQUIRED)
    overlapped: list[bool] = field(default_factory=list, metadata=REQUIRED)
    cached: list[int] = field(
        default_factory=list, metadata=REQUIRED
    )  # per slot (every rank reports it)
    # per slot, per committed token of a row that asks (else []): the target's logprob of
    # it, then its top N ids and their logprobs (runtime.speculation.processors.token_logprobs)
    logprobs: list[list[list[float]]] | None = None
    # a prefill's, per slot: the records of its chunk's tokens after the first (positions
    # cached + 1 on), for rows that ask for prompt logprobs (else [])
    prompt_logprobs: list[list[list[float]]] | None = None
    # per slot, why its grammar's matcher failed ('' for none; None when no slot's did): its
    # masks allowed only the stop tokens, and the request ends with this error
    grammar_failures: list[str] | None = None

    @property
    def reports(self) -> bool:
        return self.role in (TARGET_LEADER, DRAFT_LEADER)

    def check(self) -> None:
        if self.role not in (TARGET_LEADER, DRAFT_LEADER, WORKER):
            raise ProtocolError(f"round reply: unknown role {self.role!r}")
        if len(self.tokens) != len(self.accepted) or (
            self.overlapped and len(self.overlapped) != len(self.tokens)
        ):
            raise ProtocolError("round reply: tokens, accepted, overlapped differ in length")
        if self.grammar_failures is not None and len(self.grammar_failures) != len(self.tokens):
            raise ProtocolError("round reply: grammar_failures and tokens differ in length")
        if self.role == WORKER and self.tokens:
            raise ProtocolError("round reply: only the target leader reports tokens")


Reply = RoundReply | StepAck
R = TypeVar("R", RoundReply, StepAck)


def expect(reply: Reply, kind: type[R]) -> R:
    """`reply` when it is a `kind` (every reply to a command is of one kind), else
    ProtocolError."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected a {kind.NAME} reply, got {reply.NAME!r}")
    return reply
