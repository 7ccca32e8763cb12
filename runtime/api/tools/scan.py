"""The tool-call formats read a character at a time (runtime/api/tools/parsers.py drives them):
each scanner turns generated text into events, in order, that never need taking back:
("content", text), ("call", name) when a call starts, ("args", text) as its arguments' JSON
grows. What a scanner cannot yet decide (a partial "<tool_call>", whitespace that may precede
a call, a call's JSON before its name and the "arguments" key are read) it holds back until
it can. The rules (docs: the module docstring of tools/parsers.py):

- a call's JSON object is `{"name": NAME, "arguments": {...}, ...}` ("parameters" is taken
  for "arguments" in both formats); once NAME and the arguments' "{" are read the call is
  committed and its arguments stream as they come, checked as JSON (tools/json_prefix.py);
  a committed call's arguments are the raw text of that object as generated, or, if the
  text ends or stops being valid JSON first, the valid part read until then (as a
  truncated OpenAI call's); a call object in another key order is held whole, then read
  with json.loads (its arguments are re-serialised);
- text that is not a call (bad JSON before the commit, no name) is content, as generated;
- whitespace just before a call is dropped, and so is whitespace after the last call that
  ends the output; all other text is content."""

from __future__ import annotations

import json
import re

from runtime.api.tools.json_prefix import WS, JsonPrefix

Event = tuple[str, str]  # ("content" | "call" | "args", text)

_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
MORE, DONE, INVALID, REJECTED = "more", "done", "invalid", "rejected"


def emit(out: list[Event], kind: str, text: str) -> None:
    """Append an event (a non-empty one: merged() joins runs of one kind)."""
    if text:
        out.append((kind, text))


def merged(events: list[Event]) -> list[Event]:
    """The events with each run of content, or of one call's arguments, joined."""
    out: list[Event] = []
    run: list[str] = []
    for i, (kind, text) in enumerate(events):
        run.append(text)
        if kind == "call" or i + 1 == len(events) or events[i + 1][0] != kind:
            out.append((kind, "".join(run)))
            run = []
    return out


def whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object read at once; None if it is no call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments given as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class CallReader:
    """One call's JSON object, from its "{": feed() gives MORE, DONE (the object is whole;
    its call was emitted), INVALID (whole, but no call: nothing emitted) or REJECTED (the
    character cannot follow; nothing of it was kept)."""

    def __init__(self) -> None:
        self.json = JsonPrefix()
        self.body: list[str] = []
        self.announced = False  # its "call" event was emitted
        self.in_args = False  # the characters read are the arguments'

    def feed(self, c: str, out: list[Event]) -> str:
        depth = self.json.depth
        if not self.json.feed(c):
            return REJECTED
        self.body.append(c)
        if self.in_args:
            emit(out, "args", c)
            self.in_args = self.json.depth >= 2
        elif not self.announced and c == "{" and depth == 1 and self.json.depth == 2:
            header = _HEADER.fullmatch("".join(self.body))
            if header is not None:
                name = json.loads(header.group(1))
                if name:
                    self.announced = self.in_args = True
                    out.append(("call", name))
                    emit(out, "args", c)
        if not self.json.done:
            return MORE
        if self.announced:
            return DONE
        call = whole_call("".join(self.body))
        if call is None:
            return INVALID
        out.append(("call", call[0]))
        emit(out, "args", call[1])
        return DONE

    def text(self) -> str:
        return "".join(self.body)


class Held:
    """Text held back: a run of whitespace, then part of a marker."""

    def __init__(self) -> None:
        self.ws: list[str] = []
        self.tag = ""

    def text(self) -> str:
        return "".join(self.ws) + self.tag


class HermesScanner:
    """`<tool_call>` JSON `</tool_call>`, any number of them, content before, between and
    after (Qwen 2.5 / 3, Hermes 2 Pro / 3 and others)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.state = "text"  # text | open (after <tool_call>) | call | close | skip
        self.held = Held()  # text: before a possible <tool_call>; close: before </tool_call>
        self.after_call = False  # text: only whitespace since the last call
        self.raw = ""  # open / call: the call's text so far, as content if it is none
        self.reader = CallReader()
        self.tail = ""  # skip: the last characters read

    def feed(self, c: str, out: list[Event]) -> None:
        getattr(self, "_" + self.state)(c, out)

    def finish(self, out: list[Event]) -> None:
        if self.state == "text" and not (self.after_call and not self.held.tag):
            emit(out, "content", self.held.text())
        elif self.state in ("open", "call") and not self.reader.announced:
            emit(out, "content", self.raw + self.reader.text())
        self.state, self.held = "text", Held()

    def _text(self, c: str, out: list[Event]) -> None:
        held = self.held
        self.after_call = self.after_call and c in WS
        if not held.tag and c in WS:
            held.ws.append(c)
            return
        tail = held.tag + c
        if tail == self.OPEN:
            self.state, self.raw, self.held = "open", held.text() + c, Held()
            return
        k = _marker_start(tail, self.OPEN)
        if k == len(tail):
            held.tag = tail
            return
        head = tail[: len(tail) - k]  # starts with a non-whitespace character
        body = head.rstrip(WS)
        emit(out, "content", "".join(held.ws) + body)
        held.ws, held.tag = list(head[len(body) :]), tail[len(tail) - k :]

    def _open(self, c: str, out: list[Event]) -> None:
        if c in WS:
            self.raw += c
        elif c == "{":
            self.state, self.reader = "call", CallReader()
            self.reader.feed(c, out)
        else:
            self._not_a_call(c, out)

    def _call(self, c: str, out: list[Event]) -> None:
        status = self.reader.feed(c, out)
        if status == DONE:
            self.state, self.held = "close", Held()
        elif status == INVALID:
            emit(out, "content", self.raw + self.reader.text())
            self.state = "text"
        elif status == REJECTED and self.reader.announced:
            self.state, self.tail = "skip", ""
        elif status == REJECTED:
            self._not_a_call(c, out, self.reader.text())

    def _not_a_call(self, c: str, out: list[Event], body: str = "") -> None:
        emit(out, "content", self.raw + body)
        self.state, self.reader = "text", CallReader()
        self._text(c, out)

    def _close(self, c: str, out: list[Event]) -> None:
        """After a call's object: whitespace, then its `</tool_call>` (optional)."""
        held = self.held
        if not held.tag and c in WS:
            held.ws.append(c)
            return
        if self.CLOSE.startswith(held.tag + c):
            held.tag += c
            if held.tag == self.CLOSE:
                self.state, self.held, self.after_call = "text", Held(), True
            return
        read = held.text() + c
        self.state, self.held, self.after_call = "text", Held(), True
        for ch in read:
            self._text(ch, out)

    def _skip(self, c: str, out: list[Event]) -> None:
        """A committed call whose JSON went bad: dropped up to its `</tool_call>` (or the next
        `<tool_call>`)."""
        self.tail = (self.tail + c)[-len(self.CLOSE) :]
        if self.tail.endswith(self.CLOSE):
            self.state, self.after_call = "text", True
        elif self.tail.endswith(self.OPEN):
            self.state, self.raw = "open", self.OPEN


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Llama3Scanner:
    """Llama 3.x's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
    calls separated by ";", optionally after `<|python_tag|>` (kept when special tokens are
    shown); an output that does not start so (after whitespace) is content, whole."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.state = "start"  # start | call | sep | text (content to the end) | skip
        self.read: list[str] = []  # start: whitespace and the tag; sep: whitespace and ";"
        self.tag = ""  # start: the part of the tag read
        self.semicolon = False  # sep: the ";" was read
        self.raw = ""  # call: the text before its "{" (content if it is no call)
        self.reader = CallReader()

    def feed(self, c: str, out: list[Event]) -> None:
        getattr(self, "_" + self.state)(c, out)

    def finish(self, out: list[Event]) -> None:
        if self.state == "start":
            emit(out, "content", "".join(self.read))
        elif self.state == "call" and not self.reader.announced:
            emit(out, "content", self.raw + self.reader.text())
        self.state, self.read = "skip", []

    def _start(self, c: str, out: list[Event]) -> None:
        whole = self.tag in ("", self.TAG)  # no part of the tag, or all of it, was read
        if c == "{" and whole:
            self._begin_call(c, out)
            return
        self.read.append(c)
        if c in WS and whole:
            return
        if self.tag != self.TAG and self.TAG.startswith(self.tag + c):
            self.tag += c
            return
        emit(out, "content", "".join(self.read))
        self.state, self.read = "text", []

    def _begin_call(self, c: str, out: list[Event]) -> None:
        self.state, self.raw, self.read = "call", "".join(self.read), []
        self.reader = CallReader()
        self.reader.feed(c, out)

    def _call(self, c: str, out: list[Event]) -> None:
        status = self.reader.feed(c, out)
        if status == DONE:
            self.state, self.read, self.semicolon = "sep", [], False
        elif status == REJECTED and self.reader.announced:
            self.state = "skip"
        elif status != MORE:  # INVALID or REJECTED before the commit: content from here on
            emit(out, "content", self.raw + self.reader.text())
            self.state = "text"
            if status == REJECTED:
                emit(out, "content", c)

    def _sep(self, c: str, out: list[Event]) -> None:
        if c in WS or (c == ";" and not self.semicolon):
            self.semicolon = self.semicolon or c == ";"
            self.read.append(c)
        elif c == "{":
            self._begin_call(c, out)
        else:
            emit(out, "content", "".join(self.read) + c)
            self.state, self.read = "text", []

    def _text(self, c: str, out: list[Event]) -> None:
        emit(out, "content", c)

    def _skip(self, c: str, out: list[Event]) -> None:
        """A committed call whose JSON went bad: the rest of the output is dropped."""


class ArgumentsScanner:
    """A named function's arguments object alone (a forced choice's JSON on a model without a
    known tool-call format): the call is announced at its first non-whitespace character, and
    every character from there on is its arguments, as generated (the grammar keeps them
    valid JSON; one cut short is the valid part read)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, c: str, out: list[Event]) -> None:
        if not self.started:
            if c in WS:
                return
            self.started = True
            out.append(("call", self.name))
        emit(out, "args", c)

    def finish(self, out: list[Event]) -> None:
        """Nothing is held back."""
