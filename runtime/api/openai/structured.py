"""What constrains or reads an HTTP request's output, besides the sampling arguments:
`response_format` and vLLM's `structured_outputs` as the engine's structured_outputs argument
(runtime.params: one of {"json": schema}, {"regex": str}, {"choice": [str]}, {"grammar":
ebnf}, {"lark": lark}), and a chat's `tools` / `tool_choice` / `parallel_tool_calls` (runtime/api/
tools/request.py): the tool-call format its output is read in, and for a forced choice
("required", a named function) the grammar its calls follow (tools/grammar.py; on a
model whose chat template shows no known format, the JSON of the call: tools/parsers.py's
JSON_CALLS). Errors are 400s naming the argument.

- response_format {"type": "text"}: nothing; {"type": "json_object"}: {"json": {"type":
  "object"}}; {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}:
  {"json": schema} (enforced whatever `strict` says); another type: a 400.
- structured_outputs (vLLM's body extension): passed on as given (the engine checks it).
- both at once: a 400 naming response_format (vLLM's rule)."""

from __future__ import annotations

from runtime.api.openai.errors import HttpError
from runtime.api.tools.grammar import json_calls_schema, tool_grammar
from runtime.api.tools.parsers import JSON_CALLS, tool_parser_name
from runtime.api.tools.request import ToolRequest, parse_tool_request
from runtime.errors import ArgumentError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_ARGS = ("tools", "tool_choice", "parallel_tool_calls")


def structured_outputs(body: dict) -> tuple[dict | None, str]:
    """(the engine's structured_outputs or None, the argument that gave it)."""
    fmt, given = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and given is not None:
        raise HttpError(
            400,
            "response_format: give response_format or structured_outputs, not both",
            "response_format",
        )
    if given is not None:
        if not isinstance(given, dict):
            raise HttpError(
                400,
                'structured_outputs: expected an object such as {"json": schema}, '
                '{"regex": ...}, {"choice": [...]} or {"grammar": ...}',
                "structured_outputs",
            )
        return dict(given), "structured_outputs"
    return (None if fmt is None else _response_format(fmt)), "response_format"


def _response_format(fmt) -> dict | None:
    """OpenAI's response_format as the engine's structured_outputs: text -> None, json_object
    -> any JSON object, json_schema -> its schema (`schema` left out: any JSON object, as
    OpenAI's); a 400 naming response_format for anything else."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if isinstance(fmt, dict) and set(fmt) - {"type", "json_schema"}:
        raise _format_error(f"unknown key {sorted(set(fmt) - {'type', 'json_schema'})[0]!r}")
    if kind in ("text", "json_object"):
        if "json_schema" in fmt:
            raise _format_error("json_schema is only for type 'json_schema'")
        return None if kind == "text" else {"json": {"type": "object"}}
    if kind == "json_schema":
        return {"json": _json_schema(fmt.get("json_schema"))}
    got = kind if kind is not None else fmt
    raise _format_error(f"expected type {', '.join(RESPONSE_FORMATS)}; got {got!r}")


def _json_schema(spec) -> dict:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _format_error('json_schema: expected {"name": ..., "schema": {...}}')
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise _format_error(f"json_schema: unknown key {sorted(unknown)[0]!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _format_error("json_schema.strict: expected true or false")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _format_error("json_schema.schema: expected a JSON Schema object")
    return schema


def _format_error(words: str) -> HttpError:
    return HttpError(400, f"response_format: {words}", "response_format")


def chat_tools(body: dict) -> ToolRequest:
    """A chat body's tools, tool_choice and parallel_tool_calls, checked."""
    try:
        return parse_tool_request(body)
    except ValueError as exc:
        raise _tool_error(exc) from None


def _tool_error(exc: ValueError) -> HttpError:
    """A tool check's refusal as a 400 naming the argument it names (ArgumentError's)."""
    param = exc.param if isinstance(exc, ArgumentError) else "tools"
    return HttpError(400, str(exc), param if param in TOOL_ARGS else "tools")


def tool_format(tools: ToolRequest, configured: str | None, template) -> str:
    """The format a request's output is read in: the configured parser (server.tool_parser),
    else the one the chat template shows, else for a forced choice JSON_CALLS (its grammar
    forces the JSON: any model); a 400 naming tools when "auto" has none."""
    try:
        return tool_parser_name(configured, template)
    except ValueError as exc:
        if tools.forced and configured is None:
            return JSON_CALLS
        raise _tool_error(exc) from None


def forced_grammar(tools: ToolRequest, parser: str) -> dict | None:
    """The structured_outputs that a forced choice's calls follow, {"grammar": ebnf} or
    {"lark": lark} where a tool's parameters need llguidance (tools.grammar; building it
    compiles: call it off the event loop); None when the choice forces nothing. JSON_CALLS:
    {"json": schema} (tools.grammar.json_calls_schema; the engine checks it)."""
    if parser == JSON_CALLS:
        schema = json_calls_schema(tools)
        return None if schema is None else {"json": schema}
    grammar = tool_grammar(tools, parser)
    if grammar is None:
        return None
    try:
        spec = grammar.spec()
        return {spec.kind: spec.text}
    except ImportError:
        raise HttpError(
            501,
            "tool_choice: forcing tool calls needs xgrammar, which this server lacks",
            "tool_choice",
            kind="server_error",
        ) from None
    except ValueError as exc:  # llguidance's refusal, naming the tool (ToolGrammar.spec)
        raise HttpError(400, str(exc), "tools") from None
    except Exception as exc:  # noqa: BLE001 - xgrammar refuses a schema with its own errors
        message = f"tools: a tool's parameters cannot be enforced: {exc}"
        raise HttpError(400, message, "tools") from None
