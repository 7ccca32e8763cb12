"""Per-request sampling parameters and their validation (errors name the argument)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

PARAM_NAMES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @classmethod
    def from_kwargs(cls, **kwargs) -> SamplingParams:
        unknown = sorted(set(kwargs) - set(PARAM_NAMES))
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}; known: {list(PARAM_NAMES)}")
        values = {k: v for k, v in kwargs.items() if v is not None or k in ("top_k", "seed")}
        stop = values.get("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop: expected a string or a list of strings, got {stop!r}")
        values["stop"] = tuple(stop)
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        _int("max_new_tokens", self.max_new_tokens, minimum=1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        if self.top_k is not None:
            _int("top_k", self.top_k, minimum=0)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if self.seed is not None:
            _int("seed", self.seed, minimum=0)
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def check_prompt_ids(ids, vocab_size: int, name: str = "prompt_token_ids") -> list[int]:
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        raise ValueError(f"{name}: expected a non-empty list of token ids")
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise ValueError(
                f"{name}: token id {tok!r} is outside the vocabulary [0, {vocab_size})"
            )
    return list(ids)


def check_fits(
    prompt_len: int, max_new_tokens: int, max_seq_len: int, name: str, index: int | None = None
) -> None:
    """A ValueError unless a prompt of `prompt_len` tokens and `max_new_tokens` fit in
    runtime.max_seq_len: naming `name` (the prompt) when the prompt alone leaves no room for a
    new token, else max_new_tokens. `index`: which prompt of several (from 0; said from 1)."""
    which = "the prompt" if index is None else f"prompt {index + 1}"
    if prompt_len >= max_seq_len:
        raise ValueError(
            f"{name}: {which} is {prompt_len} tokens, too long for "
            f"runtime.max_seq_len ({max_seq_len}), which must hold the prompt "
            f"and at least one new token; shorten it or raise "
            f"runtime.max_seq_len"
        )
    if prompt_len + max_new_tokens > max_seq_len:
        raise ValueError(
            f"max_new_tokens: {which} ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds runtime.max_seq_len ({max_seq_len}); "
            f"at most {max_seq_len - prompt_len} new tokens fit"
        )
