"""The field types of the HTTP front's request bodies (runtime/api/openai/bodies.py). Each is
a pydantic type that carries its JSON Schema (type, bounds, choices: what /openapi.json shows)
and its check, whose ValueError says what is accepted in the engine's words ("expected a
finite number in [0, 2], got 3"); the 400 puts the argument before it
(openai.errors.validation_error). A check runs before pydantic's own, so a bool is never
taken for a number and one message covers a union ("a string or a list of strings").

A field whose value is checked where it is used (tools, messages, response_format: their
checks name the part at fault) is `Annotated[Any, WithJsonSchema(schema)]`
(runtime/api/openai/schemas.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from runtime.params import LOGIT_BIAS_LIMIT


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_INT = 2**63 - 1  # the largest integer the engine's wire (msgpack) carries signed


def _integral(value: Any) -> int | None:
    """An integer of at most MAX_INT, or a float without a fraction (JSON Schema's integer
    includes 2.0); None for anything else (a bool is not an integer)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT:
        return value
    return None


def _range_words(low: float, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}]"


@dataclass(frozen=True)
class Range:
    """`Annotated[float, Range(0, 2)]`: a finite number >= low (> low when `low_open`),
    <= high when given; `Annotated[int, Range(0)]`: an integer (2.0 is 2), at most
    MAX_INT."""

    low: float
    high: float | None = None
    low_open: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        integral = source is int
        kind = "an integer" if integral else "a finite number"
        words = f"expected {kind} {_range_words(self.low, self.high, self.low_open)}"

        def check(value: Any) -> Any:
            if integral:
                number = _integral(value)
                if number is None and isinstance(value, int) and not isinstance(value, bool):
                    raise ValueError(f"expected an integer below 2**63, got {value!r}")
            else:
                number = value if _is_number(value) and math.isfinite(value) else None
            low, high = self.low, self.high
            if number is None or number < low or (self.low_open and number == low):
                raise ValueError(f"{words}, got {value!r}")
            if high is not None and number > high:
                raise ValueError(f"{words}, got {value!r}")
            return number

        return core_schema.no_info_before_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        out = handler(schema)
        out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None or out.get("type") == "integer":
            out["maximum"] = MAX_INT if self.high is None else self.high
        return out


def _flag(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


Flag = Annotated[bool, BeforeValidator(_flag)]


def _strings(value: Any) -> Any:
    if isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    ):
        return value
    raise ValueError(f"expected a string or a list of strings, got {value!r}")


Strings = Annotated[str | list[str], BeforeValidator(_strings)]


def _token_ids(value: Any) -> Any:
    ids = _ids(value)
    if ids is None:
        raise ValueError(f"expected a list of token ids, got {value!r}")
    return ids


TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
TokenIds = Annotated[list[TokenId], BeforeValidator(_token_ids)]


def _bias_key(value: Any) -> Any:
    if isinstance(value, str) and value.strip().isdigit():
        return value
    raise ValueError(f"key {value!r} is not a token id")


LogitBias = dict[
    Annotated[str, Field(pattern=r"^[0-9]+$"), BeforeValidator(_bias_key)],
    Annotated[float, Range(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)],
]


def _ids(value: Any) -> list[int] | None:
    """Token ids (>= 0, integers or floats without a fraction), or None."""
    if not isinstance(value, list):
        return None
    ids = [_integral(t) for t in value]
    if any(t is None or t < 0 for t in ids):
        return None
    return [t for t in ids if t is not None]


def _prompt(value: Any) -> Any:
    if isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(p, str) for p in value)
    ):
        return value
    ids = _ids(value)
    if ids is not None:
        return ids
    rows = [_ids(row) for row in value] if isinstance(value, list) and value else [None]
    if all(row is not None for row in rows):
        return rows
    raise ValueError(
        "expected a string, a list of strings, a list of token ids or a list of such lists"
    )


Prompt = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], BeforeValidator(_prompt)]


def _same(value: Any, allowed: Any) -> bool:
    return type(value) is type(allowed) and value == allowed  # True is not 1


class Only:
    """`Annotated[Any, Only(schema, *values)]`: an argument accepted only with one of
    `values` (its "off" values: OpenAI's arguments this server does not support), shown in
    the OpenAPI schema as `schema`."""

    def __init__(self, schema: dict, *values: Any):
        self.schema, self.values = schema, values

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        def check(value: Any) -> Any:
            if value is not None and not any(_same(value, v) for v in self.values):
                raise ValueError(f"{value!r} is not supported by this server")
            return value

        return core_schema.no_info_before_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        return dict(self.schema)
