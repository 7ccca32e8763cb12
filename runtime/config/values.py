"""The checks of single config values: each takes the value and its dotted key and returns
the value (normalised) or raises ConfigError naming the key (runtime.config.schema)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from runtime.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)  # besides null: as stored (FP8 checkpoints are detected)
ACCEPTANCE_MODES = ("tokens", "logits")
VERIFICATION_RULES = ("token", "block")  # speculation.verification (`logits` acceptance)
ADDRESS_SCHEMES = ("tcp://", "ipc://")
TOOL_PARSERS = ("hermes", "llama3_json")  # runtime.api.tools.parsers.PARSERS


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def draft_len_value(value: Any, key: str) -> int | str:
    if value == "auto":
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(key, f"must be an integer >= 1 or 'auto', got {describe(value)}")
    return int_at_least(1)(value, key)


def prefill_budget(value: Any, key: str) -> int | str | None:
    """runtime.max_prefill_tokens: an integer >= 2, null (whole prompts) or 'auto'."""
    if value == "auto" or value is None:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(key, f"must be an integer >= 2, null or 'auto', got {describe(value)}")
    return int_at_least(2)(value, key)


def int_at_least(low: int) -> Callable[[Any, str], int]:
    def check(value: Any, key: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, f"must be an integer >= {low}, got {describe(value)}")
        if value < low:
            raise ConfigError(key, f"must be >= {low}, got {value}")
        return value

    return check


def optional_int_at_least(low: int) -> Callable[[Any, str], int | None]:
    def check(value: Any, key: str) -> int | None:
        return None if value is None else int_at_least(low)(value, key)

    return check


def positive_float(value: Any, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(key, f"must be a number > 0 (seconds), got {describe(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(key, f"must be a finite number > 0 (seconds), got {value}")
    return float(value)


def seconds_at_least_0(value: Any, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(key, f"must be a number >= 0 (seconds), got {describe(value)}")
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(key, f"must be a finite number >= 0 (seconds), got {value}")
    return float(value)


def boolean(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {describe(value)}")
    return value


def fraction(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not (math.isfinite(value) and 0 < value <= 1)
    ):
        raise ConfigError(
            key, f"must be a fraction of the device's memory in (0, 1], got {describe(value)}"
        )
    return float(value)


def choice(*options: str) -> Callable[[Any, str], str]:
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in options:
            raise ConfigError(key, f"must be one of {', '.join(options)}; got {describe(value)}")
        return value

    return check


def tool_parser(value: Any, key: str) -> str | None:
    if value is not None and value not in TOOL_PARSERS:
        raise ConfigError(
            key,
            f"must be null (found in the chat template) or one of {', '.join(TOOL_PARSERS)}; "
            f"got {describe(value)}",
        )
    return value


def zmq_address(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.startswith(ADDRESS_SCHEMES):
        raise ConfigError(
            key, f"must be a ZeroMQ address starting with tcp:// or ipc://, got {describe(value)}"
        )
    return value


def optional_str(value: Any, key: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(key, f"must be a path (string), got {describe(value)}")
    return value


def quantization_mode(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise ConfigError(
            key,
            f"must be null (as stored; FP8 checkpoints are detected) or "
            f"one of {', '.join(QUANTIZATIONS)}; got {describe(value)}",
        )
    return value


def overlap_mode(value: Any, key: str) -> bool | str:
    if value != "auto" and not isinstance(value, bool):
        raise ConfigError(key, f"must be auto, true or false, got {describe(value)}")
    return value
