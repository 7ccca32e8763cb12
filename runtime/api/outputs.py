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

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "stats": dict(self.stats),
        }


@dataclass(frozen=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    index: int = 0  # which prompt of the request
