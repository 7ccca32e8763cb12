"""What a request asks its output to match, read from vLLM's `structured_outputs` or OpenAI's
`response_format`, checked against static bounds before anything is compiled.

A GrammarSpec is plain data (two strings) that can cross the wire and key a cache:

- json: a JSON schema, as compact JSON in the schema's own key order (not sorted: xgrammar
  emits an object's properties in their declared order, so the order is part of the grammar)
- json_object: any JSON object (OpenAI's {"type": "json_object"}); text ""
- regex: a regular expression the whole output matches
- choice: one of a list of strings, the list as JSON
- grammar: an EBNF grammar (xgrammar's / GBNF syntax) whose start rule is `root`
- lark: a Lark grammar in llguidance's syntax (`%json {schema}` embeds a JSON schema), run on
  llguidance; the HTTP front's forced tool calls whose parameters need llguidance
  (runtime.api.tools.grammar) use it

The bounds refuse what is plainly too large within microseconds; what passes them is still
compiled under a time and memory limit (runtime.speculation.grammar.compiler).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import ArgumentError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
MAX_SPEC_CHARS = 100_000  # a schema (as compact JSON), regex, grammar or choice list
MAX_JSON_DEPTH = 64  # objects and arrays nested in a schema document
MAX_SCHEMA_PROPERTIES = 2048  # entries of all "properties" maps of a schema together
MAX_OPTIONAL_PROPERTIES = 256  # properties of one object that are not required (their
# orders multiply: 512 compile in 0.2 s, 1000 exhaust 2 GiB)
MAX_REPEAT = 1000  # m and n of a counted repetition {m}, {m,} or {m,n} (regex, pattern, EBNF)

_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass(frozen=True)
class GrammarSpec:
    """kind (one of KINDS) and its canonical text; `argument` (the request argument it came
    from, for error messages) is not part of its identity."""

    kind: str
    text: str
    argument: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _refusal(self.argument, f"unknown kind {self.kind!r} (one of {KINDS})")
        if len(self.text) > MAX_SPEC_CHARS:
            raise _refusal(
                self.argument,
                f"the {self.kind} is {len(self.text)} characters long, "
                f"over the limit of {MAX_SPEC_CHARS}",
            )
        if self.kind != "choice":
            _check_repeats(self.text, self.argument)

    def error(self, message: str) -> ValueError:
        """An ArgumentError naming the argument this spec came from."""
        return _refusal(self.argument, f"{message}")


def parse_structured_outputs(value: Any) -> GrammarSpec:
    """vLLM's `structured_outputs`: exactly one of {"json": schema (an object, or its JSON
    text)}, {"regex": str}, {"choice": [str, ...]}, {"grammar": ebnf}, {"lark": lark},
    {"json_object": true}. ValueError("structured_outputs: ...") otherwise."""
    arg = "structured_outputs"
    if not isinstance(value, Mapping) or len(value) != 1:
        raise _refusal(
            arg, f"must be a map with exactly one of {sorted(KINDS)}, got {_show(value)}"
        )
    ((kind, body),) = value.items()
    if kind == "json":
        return json_spec(body, arg)
    if kind in ("regex", "grammar", "lark"):
        if not isinstance(body, str) or (kind != "regex" and not body.strip()):
            raise _refusal(arg, f"{kind} must be a non-empty string, got {_show(body)}")
        return GrammarSpec(kind, body, arg)
    if kind == "choice":
        return _choice_spec(body, arg)
    if kind == "json_object":
        if body is not True:
            raise _refusal(arg, f"json_object must be true, got {_show(body)}")
        return GrammarSpec("json_object", "", arg)
    raise _refusal(arg, f"unknown key {kind!r} (one of {sorted(KINDS)})")


def json_spec(schema: Any, argument: str) -> GrammarSpec:
    """A JSON schema (a map, or its JSON text) -> GrammarSpec("json", compact JSON)."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise _refusal(argument, f"the schema is over {MAX_SPEC_CHARS} characters long")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise _refusal(argument, f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise _refusal(argument, f"a JSON schema must be a JSON object, got {_show(schema)}")
    _check_schema_shape(schema, argument)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _refusal(argument, f"the schema is not plain JSON: {e}") from None
    return GrammarSpec("json", text, argument)


def _choice_spec(body: Any, arg: str) -> GrammarSpec:
    if not isinstance(body, list | tuple) or not body:
        raise _refusal(arg, f"choice must be a non-empty list of strings, got {_show(body)}")
    bad = [c for c in body if not isinstance(c, str)]
    if bad:
        raise _refusal(arg, f"every choice must be a string, got {_show(bad[0])}")
    return GrammarSpec("choice", json.dumps(list(body), ensure_ascii=False), arg)


def choice_ebnf(spec: GrammarSpec) -> str:
    """The EBNF of a choice spec: root ::= "first" | "second" | ..."""
    choices = json.loads(spec.text)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_schema_shape(schema: Mapping, argument: str) -> None:
    """Nesting depth and property counts within bounds (iterative: a deep document must not
    hit Python's recursion limit before it is refused)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    properties = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _refusal(
                argument, f"the schema nests deeper than {MAX_JSON_DEPTH} objects and arrays"
            )
        if isinstance(node, Mapping):
            properties += _count_properties(node, argument)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise _refusal(
            argument,
            f"the schema has {properties} properties, over the limit of {MAX_SCHEMA_PROPERTIES}",
        )


def _count_properties(node: Mapping, argument: str) -> int:
    properties = node.get("properties")
    if not isinstance(properties, Mapping):
        return 0
    listed = node.get("required")
    required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
    optional = sum(1 for name in properties if name not in required)
    if optional > MAX_OPTIONAL_PROPERTIES:
        raise _refusal(
            argument,
            f"an object of the schema has {optional} optional properties, over "
            f"the limit of {MAX_OPTIONAL_PROPERTIES}",
        )
    return len(properties)


def _check_repeats(text: str, argument: str) -> None:
    for match in _REPEAT.finditer(text):
        counts = [int(c) for c in match.groups() if c]
        if max(counts) > MAX_REPEAT:
            raise _refusal(
                argument, f"the repetition {match.group(0)} counts past the limit of {MAX_REPEAT}"
            )


def _no_unknown_keys(value: Mapping, known: set[str], argument: str, inside: str = "") -> None:
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise _refusal(argument, f"{inside}unknown key {unknown[0]!r} (known: {sorted(known)})")


def _refusal(argument: str, words: str) -> ArgumentError:
    """The refusal of the request argument `argument` ("structured_outputs: ...")."""
    return ArgumentError(f"{argument}: {words}", argument)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
