"""An incremental JSON checker for the tool-call parsers (runtime/api/tools/parsers.py): fed one
character at a time, it says whether the text so far is still a prefix of valid JSON (RFC 8259:
strings with their escapes, numbers, true / false / null, objects and arrays), how deep in
containers it is, and when one whole value has been read. It keeps no copy of the text."""

from __future__ import annotations

WS = " \t\n\r"  # JSON's whitespace
_ESCAPES = set('"\\/bfnrt')
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

# a number's states (RFC 8259's grammar as a DFA); a character's class: "0", "d" (1-9),
# "e" (e or E), or itself
_NUMBER: dict[str, dict[str, str]] = {
    "start": {"-": "minus", "0": "zero", "d": "int"},
    "minus": {"0": "zero", "d": "int"},
    "zero": {".": "dot", "e": "e"},
    "int": {"0": "int", "d": "int", ".": "dot", "e": "e"},
    "dot": {"0": "frac", "d": "frac"},
    "frac": {"0": "frac", "d": "frac", "e": "e"},
    "e": {"+": "sign", "-": "sign", "0": "exp", "d": "exp"},
    "sign": {"0": "exp", "d": "exp"},
    "exp": {"0": "exp", "d": "exp"},
}
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


def _number_class(c: str) -> str:
    if c in "123456789":
        return "d"
    return "e" if c in "eE" else c


class JsonPrefix:
    """Reads one JSON value a character at a time: feed() is False for a character that no
    valid JSON could have there (the checker is then no longer usable); `depth` is the number
    of objects and arrays open; `done` is True once a whole value has been read."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # "{" or "[" per open container
        self.expect = "value"  # value | first (after "[") | key | first_key | colon | after
        self.string: int | None = None  # in a string: 0, 1 after "\", 2-5 in a \uXXXX
        self.key = False  # the string being read is an object's key
        self.number: str | None = None  # in a number: its DFA state
        self.literal = ""  # in true / false / null: the characters still expected
        self.done = False

    @property
    def depth(self) -> int:
        return len(self.stack)

    def feed(self, c: str) -> bool:
        if self.string is not None:
            return self._string_char(c)
        if self.literal:
            if c != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_done()
            return True
        if self.number is not None:
            state = _NUMBER[self.number].get(_number_class(c))
            if state is not None:
                self.number = state
                return True
            if self.number not in _NUMBER_ENDS:
                return False
            self.number = None
            self._value_done()
        if c in WS:
            return True
        if self.done:
            return False
        return self._structural(c)

    def _structural(self, c: str) -> bool:
        expect = self.expect
        if expect in ("value", "first"):
            if c == "]" and expect == "first":
                return self._close()
            return self._value_start(c)
        if expect in ("key", "first_key"):
            if c == "}" and expect == "first_key":
                return self._close()
            if c == '"':
                self.string, self.key = 0, True
                return True
            return False
        if expect == "colon":
            if c == ":":
                self.expect = "value"
            return c == ":"
        if c == ",":  # expect == "after": after a value inside a container
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return True
        if c == {"{": "}", "[": "]"}[self.stack[-1]]:
            return self._close()
        return False

    def _value_start(self, c: str) -> bool:
        if c in "{[":
            self.stack.append(c)
            self.expect = "first_key" if c == "{" else "first"
        elif c == '"':
            self.string, self.key = 0, False
        elif c in _LITERALS:
            self.literal = _LITERALS[c]
        elif c in "-0123456789":
            self.number = _NUMBER["start"][_number_class(c)]
        else:
            return False
        return True

    def _string_char(self, c: str) -> bool:
        state = self.string
        if state == 0:
            if c == '"':
                self.string = None
                if self.key:
                    self.expect = "colon"
                else:
                    self._value_done()
            elif c == "\\":
                self.string = 1
            elif ord(c) < 0x20:
                return False
            return True
        if state == 1:
            if c == "u":
                self.string = 2
                return True
            self.string = 0
            return c in _ESCAPES
        if c not in _HEX:
            return False
        self.string = 0 if state == 5 else (state or 0) + 1
        return True

    def _close(self) -> bool:
        self.stack.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        if self.stack:
            self.expect = "after"
        else:
            self.done = True
