"""What generate() and stream() hand back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: dict = field(
        default_factory=dict
    )  # acceptance_rate, mean_accepted_tokens, rounds, tokens_per_s
    # per generated token {token id: logprob}: the chosen one and the top N (logprobs=N)
    logprobs: list[dict[int, float]] | None = None
    # per prompt token, the first None (prompt_logprobs=N)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def to_json(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "stats": dict(self.stats),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{str(t): lp for t, lp in e.items()} for e in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [
                None if e is None else {str(t): lp for t, lp in e.items()}
                for e in self.prompt_logprobs
            ]
        return out

    @classmethod
    def of(cls, o: dict) -> GenerationOutput:
        """From a Final reply's output (runtime.serving.sequence.Sequence.output)."""
        return cls(
            o["text"],
            o["token_ids"],
            o["finish_reason"],
            o["stats"],
            entries(o.get("logprobs")),
            None
            if o.get("prompt_logprobs") is None
            else [None if e is None else {int(t): lp for t, lp in e} for e in o["prompt_logprobs"]],
        )


def entries(pairs: list | None) -> list[dict[int, float]] | None:
    """[[id, logprob], ...] per token (the wire's form) -> {id: logprob} per token."""
    if pairs is None:
        return None
    return [{int(t): lp for t, lp in entry} for entry in pairs]


@dataclass(frozen=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    index: int = 0  # which sequence of the request (prompt p's sample j: p * n + j)
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when asked
