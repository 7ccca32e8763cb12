"""Per-request sampling parameters and their validation (errors name the argument: an
ArgumentError carries it as `param`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from runtime.errors import ArgumentError

MAX_LOGPROBS = 20  # OpenAI's most top_logprobs (the server's cap: server.max_logprobs)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling arguments, with vLLM's SamplingParams meanings."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids ascending
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top alternatives per generated token (0: the chosen alone)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    n: int = 1  # independent samples of each prompt
    # one of {"json": schema}, {"regex": str}, {"choice": [str]}, {"grammar": ebnf}
    structured_outputs: dict | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> SamplingParams:
        return sampling_params(**kwargs)

    def validate(self) -> None:
        check(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def bias(self) -> dict[int, float]:
        return dict(self.logit_bias)

    def to_dict(self) -> dict:
        return params_dict(self)


PARAM_NAMES = tuple(f.name for f in fields(SamplingParams))


def sampling_params(**kwargs) -> SamplingParams:
    """Checked params from keyword arguments (None leaves an argument at its default)."""
    unknown = sorted(set(kwargs) - set(PARAM_NAMES))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; known: {list(PARAM_NAMES)}")
    values = {k: v for k, v in kwargs.items() if v is not None}
    values["stop"] = _strings("stop", values.get("stop", ()))
    values["stop_token_ids"] = _ids("stop_token_ids", values.get("stop_token_ids", ()))
    values["logit_bias"] = _bias(values.get("logit_bias", ()))
    params = SamplingParams(**values)
    check(params)
    return params


def check(p: SamplingParams) -> None:
    """An ArgumentError naming the first argument out of its range."""
    _int("max_new_tokens", p.max_new_tokens, minimum=0 if p.prompt_logprobs is not None else 1)
    _number("temperature", p.temperature, 0, math.inf)
    if p.top_k is not None:
        _int("top_k", p.top_k, minimum=0)
    _number("top_p", p.top_p, 0, 1, low_open=True)
    if p.seed is not None:
        _int("seed", p.seed, minimum=0)
    if any(not s for s in p.stop):
        raise ArgumentError("stop: stop strings must be non-empty", "stop")
    _number("min_p", p.min_p, 0, 1)
    _number("presence_penalty", p.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
    _number("frequency_penalty", p.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
    _number("repetition_penalty", p.repetition_penalty, 0, math.inf, low_open=True)
    _int("min_tokens", p.min_tokens, minimum=0)
    if p.min_tokens > p.max_new_tokens:
        raise ArgumentError(
            f"min_tokens: {p.min_tokens} is more than max_new_tokens ({p.max_new_tokens})",
            "min_tokens",
        )
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise ArgumentError(f"{name}: expected true or false, got {getattr(p, name)!r}", name)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None:
            _int(name, value, minimum=0)  # the cap is the server's (server.max_logprobs)
    _int("n", p.n, minimum=1)
    if p.structured_outputs is not None:
        from runtime.speculation.grammar.spec import parse_structured_outputs

        parse_structured_outputs(p.structured_outputs)
        if p.min_tokens:  # a complete grammar allows only the stop tokens min_tokens masks
            raise ArgumentError(
                "min_tokens: not with structured_outputs (the grammar ends it)", "min_tokens"
            )


def params_dict(p: SamplingParams) -> dict:
    """Plain data (lists for tuples, logit_bias as {id: bias}): what a client sends."""
    d = asdict(p)
    d["stop"], d["stop_token_ids"] = list(p.stop), list(p.stop_token_ids)
    d["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    return d


def _strings(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise ArgumentError(f"{name}: expected a string or a list of strings, got {value!r}", name)
    return tuple(value)


def _ids(name: str, value) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ArgumentError(f"{name}: expected a list of token ids, got {value!r}", name)
    return tuple(value)


def _bias(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as OpenAI sends it ({"50256": -100}) or as pairs -> (id, bias) by id."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, b) for k, b in items]
    except (TypeError, ValueError):
        raise ArgumentError(
            f"logit_bias: expected a map of token ids to biases, got {value!r}", "logit_bias"
        ) from None
    out = {}
    for key, bias in pairs:
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ArgumentError(f"logit_bias: key {key!r} is not a token id", "logit_bias")
        where = f"logit_bias[{key}]"
        _number(where, bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, param="logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _number(
    name: str, value, low: float, high: float, low_open: bool = False, param: str | None = None
) -> None:
    """An ArgumentError naming `name` (the argument `param`, by default `name`) unless
    `value` is a finite number in the range."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or value > high or (low_open and value == low):
        if high == math.inf:
            relation = ">" if low_open else ">="
            words = f"expected a finite number {relation} {low:g}"
        else:
            words = f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ArgumentError(f"{name}: {words}, got {value!r}", param or name)


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{name}: expected an integer >= {minimum}, got {value!r}", name)


def check_prompt_ids(ids, vocab_size: int, name: str = "prompt_token_ids") -> list[int]:
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        raise ArgumentError(f"{name}: expected a non-empty list of token ids", name)
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise ArgumentError(
                f"{name}: token id {tok!r} is outside the vocabulary [0, {vocab_size})", name
            )
    return list(ids)


def check_fits(
    prompt_len: int, max_new_tokens: int, max_seq_len: int, name: str, index: int | None = None
) -> None:
    """An ArgumentError unless a prompt of `prompt_len` tokens and `max_new_tokens` fit in
    runtime.max_seq_len: naming `name` (the prompt) when the prompt alone leaves no room for a
    new token, else max_new_tokens. `index`: which prompt of several (from 0; said from 1)."""
    which = "the prompt" if index is None else f"prompt {index + 1}"
    if prompt_len >= max_seq_len:
        raise ArgumentError(
            f"{name}: {which} is {prompt_len} tokens, too long for "
            f"runtime.max_seq_len ({max_seq_len}), which must hold the prompt "
            f"and at least one new token; shorten it or raise "
            f"runtime.max_seq_len",
            name,
        )
    if prompt_len + max_new_tokens > max_seq_len:
        raise ArgumentError(
            f"max_new_tokens: {which} ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds runtime.max_seq_len ({max_seq_len}); "
            f"at most {max_seq_len - prompt_len} new tokens fit",
            "max_new_tokens",
        )
