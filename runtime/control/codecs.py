"""The checks of plain values on the wire: one Codec per annotation of a record's field
(int, float, str, bool, Any, list[X], dict[str, X]; the records nested in a record are
runtime.control.wire's), and ProtocolError, which every failed check raises naming the field.

Values of any shape (Any) are checked for depth and string keys (check_shape); typed ones
need not be: their types bound both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# lists and maps in one another: JSON schemas (a tool's parameters, structured outputs' json)
# nest two levels per level of their objects
MAX_DEPTH = 32


class ProtocolError(ValueError):
    """A frame that is not a valid message: dropped and logged, never fatal."""


def check_shape(value: Any, depth: int = 0) -> None:
    """No deeper than MAX_DEPTH, every map key a string: the check of values of any shape
    (Any). Where every field has a type, the types bound both already."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"message nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError("map keys must be strings")
            check_shape(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                check_shape(item, depth + 1)


class Codec:
    """How one annotation's values are checked: `load` (from the wire: the value to keep) and
    `dump` (to the wire: the value to send); ProtocolError naming `where` otherwise."""

    free = False  # holds values of any shape (Any somewhere): their depth and keys to check

    def load(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def dump(self, value: Any, where: str) -> Any:
        raise NotImplementedError


def expected(where: str, what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {what}, got {type(value).__name__}")


class _Any(Codec):
    free = True

    def load(self, value: Any, where: str) -> Any:
        return value

    dump = load


class _Int(Codec):
    def load(self, value: Any, where: str) -> Any:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise expected(where, "int", value)
        return value

    dump = load


class _Float(Codec):
    def load(self, value: Any, where: str) -> Any:
        if type(value) is float:
            return value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise expected(where, "float", value)
        return float(value)

    dump = load


class _Exact(Codec):
    def __init__(self, kind: type):
        self.kind = kind

    def load(self, value: Any, where: str) -> Any:
        if not isinstance(value, self.kind):
            raise expected(where, self.kind.__name__, value)
        return value

    dump = load


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


class ListOf(Codec):
    """list[X]."""

    def __init__(self, item: Codec):
        self.item = item
        self.free = item.free
        # the common lists, checked without a call per item
        self.ints = isinstance(item, _Int)
        self.int_rows = isinstance(item, ListOf) and item.ints
        self.same = isinstance(item, (_Int, _Exact, _Any)) or self.int_rows

    def load(self, value: Any, where: str) -> Any:
        if not isinstance(value, list):
            raise expected(where, "a list", value)
        return self._items(value, where, self.item.load)

    def dump(self, value: Any, where: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise expected(where, "a list", value)
        return self._items(value, where, self.item.dump)

    def _items(self, value: Any, where: str, convert: Callable[[Any, str], Any]) -> Any:
        if self.ints:
            if not _ints(value):
                raise ProtocolError(f"{where}: expected a list of int")
            return value
        if self.int_rows:
            for row in value:
                if not isinstance(row, (list, tuple)) or not _ints(row):
                    raise ProtocolError(f"{where}: expected lists of int")
            return value
        out = [convert(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value if self.same else out


def _ints(values: Any) -> bool:
    """Whether every item is an int (not a bool): plain ints at C speed, else one by one."""
    return set(map(type, values)) <= _INT_ONLY or all(map(_is_int, values))


_INT_ONLY = {int}


class MapOf(Codec):
    """dict[str, X]; dict[str, Any] holds values of any shape (check_shape checks them)."""

    def __init__(self, item: Codec):
        self.item = item
        self.free = item.free

    def load(self, value: Any, where: str) -> Any:
        if not isinstance(value, dict):
            raise expected(where, "a map", value)
        if not self.free:
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ProtocolError(f"{where}: map keys must be strings")
                self.item.load(item, f"{where}[{key!r}]")
        return value

    dump = load


SCALARS: dict[Any, Codec] = {
    Any: _Any(),
    int: _Int(),
    float: _Float(),
    str: _Exact(str),
    bool: _Exact(bool),
}
