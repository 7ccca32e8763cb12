"""What a forced tool choice ("required", a named function: tools/request.py) makes the
output follow, in a parser's format (tools/parsers.py): an xgrammar structural tag and the JSON
schema of one call object. Plain data: xgrammar is imported only by ToolGrammar.ebnf.

Structural tag (xgrammar >= 0.2's StructuralTag JSON; xgrammar.Grammar.from_structural_tag
compiles it): one "tag" per tool, begin = the call up to its arguments (fixed text: the name is
a const, so names need no JSON escaping, which tools.request checks), content = the
tool's parameters as a "json_schema", end = the rest of the call:
- hermes: `<tool_call>\n{"name": "NAME", "arguments": ` ARGS `}\n</tool_call>`, the calls
  separated by "\n" (xgrammar's builtin "qwen_3" tag spells calls so);
- llama3_json: `{"name": "NAME", "parameters": ` ARGS `}`, separated by "; " (its "llama").
A named function is that one tag; "required" is a "tags_with_separator" of all the tools'
tags with at_least_one (and stop_after_first when parallel_tool_calls is false): calls only,
no text around them. A tool with `"strict": false` takes any JSON object as arguments (as
xgrammar's builtins do); no parameters means none (`{}`). "auto" and "none" force nothing.

When any forced tool's parameters use what xgrammar does not enforce (grammar.route's
guidance_reasons: minLength, allOf, multipleOf on a number, ...), the calls are spelled the
same way in llguidance's Lark instead (ToolGrammar.lark, a "lark" GrammarSpec), every tool's
parameters a `%json` schema in the same layout (grammar.route.GUIDANCE_JSON_OPTIONS as its
"x-guidance"), so llguidance enforces them as it enforces a JSON schema:

    start: call ("\n" call)*        (a named function, or no parallel calls: start: call)
    call: call_0 | call_1
    call_0: "<tool_call>\n{\"name\": \"f\", \"arguments\": " args_0 "}\n</tool_call>"
    args_0: %json {"type": "object", ..., "x-guidance": {"item_separator": ", ", ...}}"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.api.tools.parsers import PARSERS
from runtime.api.tools.request import ToolRequest
from runtime.speculation.grammar.route import GUIDANCE_JSON_OPTIONS, guidance_reasons
from runtime.speculation.grammar.spec import GrammarSpec


@dataclass(frozen=True)
class CallFormat:
    """A parser's spelling of one call, as the grammar writes it."""

    begin: str  # up to the name
    arguments_key: str
    end: str  # after the arguments
    separator: str  # between calls

    def tag_begin(self, name: str) -> str:
        return f'{self.begin}{name}", "{self.arguments_key}": '


CALL_FORMATS = {
    "hermes": CallFormat('<tool_call>\n{"name": "', "arguments", "}\n</tool_call>", "\n"),
    "llama3_json": CallFormat('{"name": "', "parameters", "}", "; "),
}
assert set(CALL_FORMATS) == set(PARSERS)


@dataclass(frozen=True)
class ToolGrammar:
    """The constraint of a forced choice: `structural_tag` (xgrammar's JSON shape) for the
    whole output, `call_schema` for one call object."""

    parser: str
    structural_tag: dict
    call_schema: dict
    lark: str | None = None  # llguidance's Lark, when a tool's parameters need llguidance
    names: tuple[str, ...] = ()  # the tools the Lark calls, call_0 first

    def spec(self) -> GrammarSpec:
        """What the engine enforces: the Lark ("lark", checked by llguidance here: a
        ValueError naming the tool's parameters when it refuses them) or xgrammar's EBNF
        ("grammar": ebnf()); a ValueError naming tools past grammar.spec's bounds."""
        if self.lark is None:
            return GrammarSpec("grammar", self.ebnf(), "tools")
        spec = GrammarSpec("lark", self.lark, "tools")
        import llguidance

        from runtime.speculation.grammar import guidance

        grammar = llguidance.LLMatcher.grammar_from_lark(self.lark)
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=guidance.limits())
        if error:
            raise spec.error(self._refusal(error, guidance.lark_refusal(error)))
        return spec

    def _refusal(self, error: str, why: str) -> str:
        """llguidance's refusal naming the tool whose parameters it refuses (the error's
        line of the Lark: `args_I: %json ...`)."""
        found = re.match(r"at (\d+)\(", error.strip())
        lines = (self.lark or "").splitlines()
        line = lines[int(found.group(1)) - 1] if found and int(found.group(1)) <= len(lines) else ""
        tool = re.match(r"args_(\d+): ", line)
        if tool is None:
            return f"the forced calls cannot be enforced: {why}"
        name = self.names[int(tool.group(1))]
        return f"the parameters of {name!r} cannot be enforced: {why}"

    def ebnf(self) -> str:
        """The structural tag as xgrammar's EBNF (needs xgrammar), each call's arguments in
        one JSON layout: separators ", " and ": ", no other whitespace (any whitespace, the
        structural tag's own JSON, lets a weak model loop on it; the engine's JSON is so too)."""
        import xgrammar

        def compact(fmt: dict) -> dict:
            if fmt.get("type") == "json_schema":
                schema = xgrammar.Grammar.from_json_schema(fmt["json_schema"], any_whitespace=False)
                return {"type": "grammar", "grammar": str(schema)}
            out = dict(fmt)
            if "content" in fmt:
                out["content"] = compact(fmt["content"])
            if "tags" in fmt:
                out["tags"] = [compact(t) for t in fmt["tags"]]
            return out

        tag = {**self.structural_tag, "format": compact(self.structural_tag["format"])}
        return str(xgrammar.Grammar.from_structural_tag(tag))


def tool_grammar(req: ToolRequest, parser: str) -> ToolGrammar | None:
    """The constraint for `req` in `parser`'s format; None unless the choice forces calls."""
    if not req.forced or not req.tools:
        return None
    fmt = _format(parser)
    names = [req.function] if req.function is not None else _names(req)
    tags = [_tag(fmt, name, _arguments_schema(req, name)) for name in names]
    if req.choice == "function":
        tag: dict = tags[0]
    else:
        tag = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": fmt.separator,
            "at_least_one": True,
            "stop_after_first": not req.parallel,
        }
    structural = {"type": "structural_tag", "format": tag}
    schemas = {name: _arguments_schema(req, name) for name in names}
    guided = any(guidance_reasons(schema) for schema in schemas.values())
    lark = _lark(fmt, schemas, req.choice == "function" or not req.parallel) if guided else None
    return ToolGrammar(parser, structural, call_schema(req, parser), lark, tuple(names))


def call_schema(req: ToolRequest, parser: str) -> dict:
    """The JSON schema of one call object in `parser`'s format: {"name": const, key:
    arguments} for the named function, or any of the tools (anyOf) otherwise."""
    return _call_objects(req, _format(parser).arguments_key)


def json_calls_schema(req: ToolRequest) -> dict | None:
    """What a forced choice's output is on a model without a known tool-call format (the
    JSON_CALLS format, tools/parsers.py): the named function's arguments object, or, for
    "required", one call object {"name": const, "arguments": ...} of any tool; None unless
    the choice forces calls."""
    if not req.forced or not req.tools:
        return None
    if req.function is not None:
        return _arguments_schema(req, req.function)
    return _call_objects(req, "arguments")


def _call_objects(req: ToolRequest, key: str) -> dict:
    names = [req.function] if req.function is not None else _names(req)
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": name},
                key: _arguments_schema(req, name),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name in names
    ]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _format(parser: str) -> CallFormat:
    if parser not in CALL_FORMATS:
        raise ValueError(f"tool_parser: expected one of {', '.join(PARSERS)}, got {parser!r}")
    return CALL_FORMATS[parser]


def _names(req: ToolRequest) -> list[str]:
    return [t["function"]["name"] for t in req.tools]


def _arguments_schema(req: ToolRequest, name: str) -> dict:
    for tool in req.tools:
        function = tool["function"]
        if function["name"] == name and function.get("strict") is False:
            return {"type": "object"}
    return req.parameters(name)


def _tag(fmt: CallFormat, name: str, arguments: dict) -> dict:
    return {
        "type": "tag",
        "begin": fmt.tag_begin(name),
        "content": {"type": "json_schema", "json_schema": arguments},
        "end": fmt.end,
    }


def _lark(fmt: CallFormat, schemas: dict[str, dict], one: bool) -> str:
    """The calls in llguidance's Lark: one call, or one or more separated by fmt.separator;
    each call's arguments a %json schema in the one layout."""
    start = "start: call" if one else f"start: call ({json.dumps(fmt.separator)} call)*"
    lines = [start, "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
    for i, (name, schema) in enumerate(schemas.items()):
        begin, end = json.dumps(fmt.tag_begin(name)), json.dumps(fmt.end)
        lines.append(f"call_{i}: {begin} args_{i} {end}")
        lines.append(f"args_{i}: %json {_json(_laid_out(schema))}")
    return "\n".join(lines) + "\n"


def _laid_out(schema: dict) -> dict:
    """The schema with GUIDANCE_JSON_OPTIONS over its own "x-guidance" (as the JSON path's
    overrides are: grammar.guidance.guidance_grammar)."""
    own = schema.get("x-guidance", {})
    if not isinstance(own, Mapping):
        return schema  # llguidance refuses it, as it would the schema alone
    return {**schema, "x-guidance": {**own, **GUIDANCE_JSON_OPTIONS}}


def _json(value: dict) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError as e:
        raise ValueError(f"tools: a tool's parameters are not plain JSON: {e}") from None
