"""A model's generated text as OpenAI tool calls, whole or streamed.

Formats (a parser is picked by name, or detected from the chat template):
- "hermes": `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them
  (Qwen 2.5 / 3, Hermes 2 Pro / 3, SmolLM3 and others); text before the first call (and
  between calls) is the message's content. The closing tag may be left out.
- "llama3_json": Llama 3.1 / 3.2 / 3.3's JSON tool calls: the whole output is
  `{"name": "f", "parameters": {...}}`, several separated by ";", optionally after
  `<|python_tag|>`; an output that does not start with "{" (after whitespace and that tag) is
  plain content.
In both, "arguments" and "parameters" are taken alike.
- "json" (JSON_CALLS; not a server.tool_parser: the front picks it): a forced tool choice's
  output on a model whose chat template shows no known format, the JSON its grammar forces
  (tools.grammar.json_calls_schema): for a named function, the call's arguments object
  alone; for "required", one call object `{"name": "f", "arguments": {...}}` (read as
  llama3_json reads it).
A forced choice's output (ToolCallStream's `forced`) has no content: text that is no call
(a call cut short by max_tokens before its arguments began) is dropped, never shown.

Detection from a chat template's text (detect_tool_parser): "<tool_call>" in it -> hermes;
else "<|python_tag|>" or "ipython" in it -> llama3_json; else none (a template that renders
no tools, or a format not known here).

One call's JSON is read as it comes (runtime/api/tools/scan.py has the exact rules): once
its name and the start of its arguments object are read, the call is sent and its arguments
stream as the raw JSON text the model writes; text that turns out to be no call (bad JSON
before that point, no name) is content, as written; whitespace just before a call, or after
the last one at the end, is dropped. A call cut short (max_tokens), or whose arguments stop
being valid JSON, keeps the valid JSON read until then (as OpenAI's own truncated calls do);
the rest of that call is dropped. parse_tool_calls is ToolCallStream run over the whole
text, so the concatenation of a stream's deltas is the whole result, however the text was
split."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable

from runtime.api.tools.request import ToolRequest
from runtime.api.tools.scan import (
    ArgumentsScanner,
    Event,
    HermesScanner,
    Llama3Scanner,
    merged,
)
from runtime.errors import ArgumentError

PARSERS = ("hermes", "llama3_json")
JSON_CALLS = "json"  # a forced choice's JSON, for a model without a known format
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def detect_tool_parser(chat_template: str | dict | None) -> str | None:
    """The tool-call format a chat template renders (module docstring), or None. A dict of
    named templates (older tokenizers) is searched whole."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not isinstance(chat_template, str):
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


def tool_parser_name(name: str | None, chat_template: str | dict | None = None) -> str:
    """The parser named (one of PARSERS), else the one the template shows; a ValueError
    naming `tools` when there is neither."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool_parser: expected one of {', '.join(PARSERS)}, got {name!r}")
        return name
    found = detect_tool_parser(chat_template)
    if found is None:
        raise ArgumentError(
            "tools: the model's chat template shows no known tool-call format "
            f'(known: {", ".join(PARSERS)}): tool_choice "auto" needs one (set '
            'server.tool_parser); "required" or a named function work without',
            "tools",
        )
    return found


def _scanner(parser: str, function: str | None) -> HermesScanner | Llama3Scanner | ArgumentsScanner:
    if parser == "hermes":
        return HermesScanner()
    if parser == "llama3_json" or (parser == JSON_CALLS and function is None):
        return Llama3Scanner()
    if parser == JSON_CALLS and function is not None:
        return ArgumentsScanner(function)
    raise ValueError(f"tool_parser: expected one of {', '.join(PARSERS)}, got {parser!r}")


class ToolCallStream:
    """One choice's generated text read as it grows: update() takes the whole text so far
    (or feed() the new part) and gives the chat chunk deltas to send for it, in order:
    {"content": text} outside calls; for a call, {"tool_calls": [{"index", "id", "type":
    "function", "function": {"name", "arguments": ""}}]} once, then {"tool_calls": [{"index",
    "function": {"arguments": text}}]} as its arguments grow. finish() gives what was held
    back at the end; result() is then parse_tool_calls' (content, calls). `function`: the
    named function of a JSON_CALLS output; `forced`: the output of a forced choice (its
    content, text that is no call, is dropped)."""

    def __init__(
        self,
        parser: str,
        ids: Callable[[], str] = new_call_id,
        function: str | None = None,
        forced: bool = False,
    ):
        self._scanner = _scanner(parser, function)
        self._ids = ids
        self.forced = forced
        self._seen = 0  # characters fed
        self._content: list[str] = []
        self._calls: list[dict] = []
        self.finished = False

    def update(self, text: str) -> list[dict]:
        """The deltas for `text`, the whole text generated so far (it only grows)."""
        if len(text) < self._seen:
            raise ValueError("text: the generated text got shorter")
        return self.feed(text[self._seen :])

    def feed(self, delta: str) -> list[dict]:
        """The deltas for `delta`, the text generated since the last call."""
        if self.finished:
            raise ValueError("text: the stream is finished")
        events: list[Event] = []
        for c in delta:
            self._scanner.feed(c, events)
        self._seen += len(delta)
        return self._deltas(events)

    def finish(self) -> list[dict]:
        """The deltas of what was held back once the text is whole."""
        if self.finished:
            return []
        events: list[Event] = []
        self._scanner.finish(events)
        self.finished = True
        return self._deltas(events)

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, calls) so far: content None when empty and there are calls; each call
        {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
        content = "".join(self._content)
        calls = [
            {"id": c["id"], "type": "function", "function": dict(c["function"])}
            for c in self._calls
        ]
        return (None if not content and (calls or self.forced) else content), calls

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def _deltas(self, events: list[Event]) -> list[dict]:
        deltas: list[dict] = []
        for kind, text in merged(events):
            if kind == "content" and self.forced:
                continue
            if kind == "content":
                self._content.append(text)
                deltas.append({"content": text})
            elif kind == "call":
                function = {"name": text, "arguments": ""}
                call: dict = {"id": self._ids(), "type": "function", "function": function}
                self._calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self._calls) - 1, **_copy(call)}]})
            else:
                self._calls[-1]["function"]["arguments"] += text
                index = len(self._calls) - 1
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        return deltas


def _copy(call: dict) -> dict:
    return {**call, "function": dict(call["function"])}


def tool_call_stream(
    parser: str, tools: ToolRequest | None, ids: Callable[[], str] = new_call_id
) -> ToolCallStream:
    """The reader of a request's output in `parser`'s format, as its tools ask: a forced
    choice's output has no content; a JSON_CALLS output of a named function is its
    arguments."""
    function = tools.function if tools is not None else None
    forced = tools is not None and tools.forced
    return ToolCallStream(parser, ids, function, forced)


def parse_tool_calls(
    text: str,
    parser: str,
    ids: Callable[[], str] = new_call_id,
    tools: ToolRequest | None = None,
) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole generated text (ToolCallStream.result's shapes); a text
    with no call gives (text, []) (None when the choice was forced)."""
    stream = tool_call_stream(parser, tools, ids)
    stream.feed(text)
    stream.finish()
    return stream.result()


def tool_finish_reason(reason: str, has_calls: bool) -> str:
    """OpenAI's finish reason: "tool_calls" for a choice that stopped after calling tools
    ("length" stays: the last call may be cut short)."""
    return "tool_calls" if has_calls and reason == "stop" else reason
