"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (ValueErrors
that name the argument, the front's 400s), and what a choice that forces calls makes the
output follow, in the parser's format (runtime/api/tools/parsers.py):

- "none" (or no tools): no calls are read; "auto": calls are read, nothing is forced;
- "required": one or more calls (one when parallel_tool_calls is false) of any tool, and
  nothing else; a named function ({"type": "function", "function": {"name": f}}): exactly
  one call of f.

A forced choice is given (ToolGrammar) as an xgrammar structural tag (its JSON shape, for
xgrammar.Grammar.from_structural_tag; xgrammar is imported only by ToolGrammar.ebnf): each
call is a tag whose begin and end are fixed strings and whose content is the tool's
`parameters` JSON schema; for hermes `<tool_call>\n{"name": "f", "arguments": ` + arguments +
`}\n</tool_call>` (xgrammar's own "qwen_3" spelling), calls separated by "\n"; for llama3_json
`{"name": "f", "parameters": ` + arguments + `}`, separated by "; " (xgrammar's "llama"). And as
the JSON schema of one call object ({"name": const, "arguments": parameters}), for engines that
constrain the object alone."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.errors import ArgumentError

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's names (and dots): no JSON escaping
_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools (each {"type": "function", "function": {"name", "description"?,
    "parameters"}}), its choice ("none" | "auto" | "required" | "function") and, for
    "function", the function's name."""

    tools: tuple[dict, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows (apply_chat_template's tools=): all of them
        (vLLM's default, "none" included), None when there are none."""
        return [dict(t) for t in self.tools] or None

    def parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or dict(_EMPTY_PARAMETERS)
        raise KeyError(name)


def parse_tool_request(body: dict) -> ToolRequest:
    """The tool arguments of a /v1/chat/completions body, checked."""
    tools = tuple(check_tools(body.get("tools")))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ArgumentError(
            f"parallel_tool_calls: expected true or false, got {parallel!r}", "parallel_tool_calls"
        )
    choice, function = _check_choice(body.get("tool_choice"), tools)
    return ToolRequest(tools, choice, function, parallel is not False)


def check_tools(value) -> list[dict]:
    """OpenAI's `tools` as {"type": "function", "function": {...}} dicts (copies)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ArgumentError("tools: expected a list of function tools", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ArgumentError(
                f'{where}: expected {{"type": "function", "function": {{...}}}}', "tools"
            )
        function = _check_function(tool.get("function"), f"{where}.function")
        if function["name"] in names:
            raise ArgumentError(
                f"{where}.function.name: {function['name']!r} is given twice", "tools"
            )
        names.add(function["name"])
        tools.append({"type": "function", "function": function})
    return tools


def _check_function(function, where: str) -> dict:
    if not isinstance(function, dict):
        raise ArgumentError(f"{where}: expected an object with a name", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(
            f"{where}.name: expected 1 to 64 letters, digits, '_', '-' or '.', got {name!r}",
            "tools",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ArgumentError(f"{where}.description: expected a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ArgumentError(f"{where}.parameters: expected a JSON Schema object", "tools")
        if parameters.get("type", "object") != "object":
            raise ArgumentError(
                f"{where}.parameters: the arguments' schema must be of type object", "tools"
            )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ArgumentError(f"{where}.strict: expected true or false", "tools")
    known = ("name", "description", "parameters", "strict")
    return {k: function[k] for k in known if function.get(k) is not None}


def _check_choice(value, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    """(choice, function name) of OpenAI's tool_choice; its default: auto with tools, else
    none."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in _CHOICES:
            raise ArgumentError(
                f"tool_choice: expected one of {', '.join(_CHOICES)} or a named function,"
                f" got {value!r}",
                "tool_choice",
            )
        if value == "required" and not tools:
            raise ArgumentError('tool_choice: "required" needs tools', "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ArgumentError(
            'tool_choice: expected "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise ArgumentError(
            f"tool_choice: the function {name!r} is not among the tools", "tool_choice"
        )
    return "function", name
