"""One definition per message: each record of the control plane is a frozen dataclass, and the
check of its msgpack map is derived from the class's fields (runtime.control.protocol frames
them; runtime.control.commands holds the step commands and their replies).

    @message("error")                   # a message: a map tagged "type": "error"
    @dataclass(frozen=True, slots=True)
    class Error(WorkerMessage):         # (rank: int, from WorkerMessage)
        step: int
        message: str
        kind: str | None = None         # optional: sent only when not None

The wire form is a map of the tag and every field by name. A field with a default may be left
out (the default stands for it), but one with `metadata=REQUIRED` (a default for whoever
builds the record, not for the wire); a field `X | None = None` is left out when None, and
None is never a value on the wire. Annotations say what a value may be: int (not bool), float
(an int is read as a float), str, bool, Any, list[X], dict[str, X], a nested record (`record`:
a map without a tag) or a union of records tagged "kind" (`tagged`: the map names its kind).
A record's `check` adds what types cannot say (lengths that must agree, ranges); it runs where
a record is read from the wire. Every failure is a ProtocolError naming the field. How each
plain value is checked (and values of any shape: check_shape) is runtime.control.codecs'.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from runtime.control.codecs import (
    SCALARS,
    Codec,
    ListOf,
    MapOf,
    ProtocolError,
    check_shape,
    expected,
)

REQUIRED = {"wire": "required"}  # field metadata: a default for senders, not for the wire


class Record:
    """A record of the wire (a frozen dataclass, registered by `message`, `tagged` or
    `record`, which derive its `_schema`)."""

    __slots__ = ()
    TAG: ClassVar[str | None] = None  # the key that names the record's kind, if any
    NAME: ClassVar[str] = ""  # ... and its value
    _schema: ClassVar[Schema]

    def check(self) -> None:
        """What the fields' types cannot say; ProtocolError when the record makes no sense."""


class Message(Record):
    """A whole frame's record: a map tagged "type"."""

    __slots__ = ()


MESSAGES: dict[str, type[Message]] = {}  # "type" -> its class (every message registered)

R = TypeVar("R", bound=Record)
M = TypeVar("M", bound=Message)


def message(name: str) -> Callable[[type[M]], type[M]]:
    """Register a dataclass as the message tagged {"type": name}."""

    def register(cls: type[M]) -> type[M]:
        if name in MESSAGES:
            raise TypeError(f"two messages of type {name!r}")
        _derive(cls, "type", name, name)
        MESSAGES[name] = cls
        return cls

    return register


def tagged(name: str) -> Callable[[type[R]], type[R]]:
    """Register a dataclass as a nested record tagged {"kind": name} (a member of a union)."""

    def register(cls: type[R]) -> type[R]:
        _derive(cls, "kind", name, f"{name} reply")
        return cls

    return register


def record(label: str) -> Callable[[type[R]], type[R]]:
    """Register a dataclass as a nested record without a tag (`label` names it in errors)."""

    def register(cls: type[R]) -> type[R]:
        _derive(cls, None, "", label)
        return cls

    return register


def from_wire(value: Any) -> Message:
    """The message a decoded map holds (checked), else ProtocolError."""
    if not isinstance(value, dict):
        raise ProtocolError(f"message is a {type(value).__name__}, not a map")
    kind = value.get("type")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    if cls._schema.free:
        check_shape(value)
    return cls._schema.load(value, cls.NAME)


def to_wire(msg: Message) -> dict[str, Any]:
    """The map of a message (its fields checked against their types)."""
    if not isinstance(msg, Message) or not msg.NAME:
        raise ProtocolError(f"not a message: {type(msg).__name__}")
    value = msg._schema.dump(msg)
    if msg._schema.free:
        check_shape(value)
    return value


# --- the derived schema ------------------------------------------------------------------


class _Nested(Codec):
    def __init__(self, cls: type[Record]):
        self.cls = cls
        self.free = cls._schema.free

    def load(self, value: Any, where: str) -> Any:
        return self.cls._schema.load(value, where)

    def dump(self, value: Any, where: str) -> Any:
        if not isinstance(value, self.cls):
            raise expected(where, f"a {self.cls.__name__}", value)
        return value._schema.dump(value)


class _Union(Codec):
    """One of several records tagged "kind"."""

    def __init__(self, classes: tuple[type[Record], ...]):
        self.classes = classes
        self.by_kind = {c.NAME: c for c in classes}
        self.names = " or ".join(repr(c.NAME) for c in classes)
        self.free = any(c._schema.free for c in classes)

    def load(self, value: Any, where: str) -> Any:
        if not isinstance(value, dict):
            raise expected(where, "a map", value)
        kind = value.get("kind")
        cls = self.by_kind.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(f"{where}: expected kind {self.names}, got {kind!r}")
        return cls._schema.load(value, where)

    def dump(self, value: Any, where: str) -> Any:
        if not isinstance(value, self.classes):
            raise expected(where, " or ".join(c.__name__ for c in self.classes), value)
        return value._schema.dump(value)


def codec(annotation: Any) -> Codec:
    """The check of values of `annotation` (TypeError for one with no wire form)."""
    if annotation in SCALARS:
        return SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return ListOf(codec(args[0]))
    if origin is dict and args[0] is str:
        return MapOf(codec(args[1]))
    if origin in (types.UnionType, typing.Union) and all(
        isinstance(a, type) and issubclass(a, Record) and a.TAG == "kind" for a in args
    ):
        return _Union(args)
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return _Nested(annotation)
    raise TypeError(f"{annotation!r} has no wire form")


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    where: str  # how errors name it: "<record>.<field>"
    codec: Codec
    optional: bool  # may be left out
    none_absent: bool  # `X | None = None`: None is sent as no field


class Schema:
    """A record class's wire form, derived from its fields (see the module's docstring)."""

    def __init__(self, cls: type[Record], tag: str | None, name: str, label: str):
        self.cls, self.tag, self.name, self.label = cls, tag, name, label
        hints = typing.get_type_hints(cls)
        self.fields: list[_Field] = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            annotation, none_absent = hints[f.name], False
            if typing.get_origin(annotation) in (types.UnionType, typing.Union):
                args = [a for a in typing.get_args(annotation) if a is not type(None)]
                if len(args) < len(typing.get_args(annotation)):  # X | None
                    if f.default is not None or len(args) != 1:
                        raise TypeError(f"{cls.__name__}.{f.name}: only X | None = None")
                    none_absent = True
                    annotation = args[0]
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            self.fields.append(
                _Field(
                    f.name,
                    f"{label}.{f.name}",
                    codec(annotation),
                    has_default and f.metadata.get("wire") != "required",
                    none_absent,
                )
            )
        self.names = frozenset(f.name for f in self.fields)
        self.free = any(f.codec.free for f in self.fields)  # Any somewhere in it

    def load(self, value: Any, where: str) -> Any:
        """The record of a map (fields checked, then `check`)."""
        if not isinstance(value, dict):
            raise expected(where, "a map", value)
        if self.tag is not None and value.get(self.tag) != self.name:
            got = value.get(self.tag)
            raise ProtocolError(f"{where}: expected a {self.label}, got {got!r}")
        kwargs = {}
        for f in self.fields:
            if f.name in value:
                kwargs[f.name] = f.codec.load(value[f.name], f.where)
            elif not f.optional:
                raise ProtocolError(f"{self.label}: missing field {f.name!r}")
        if len(kwargs) + (self.tag is not None) != len(value):
            extra = set(value) - self.names - {self.tag}
            raise ProtocolError(f"{self.label}: unknown fields {sorted(extra, key=str)}")
        try:
            obj = self.cls(**kwargs)
        except (TypeError, ValueError) as exc:  # a __post_init__ that refuses the values
            raise ProtocolError(f"{self.label}: {exc}") from None
        obj.check()
        return obj

    def dump(self, obj: Record) -> dict[str, Any]:
        """The map of a record (fields checked against their types)."""
        out: dict[str, Any] = {self.tag: self.name} if self.tag is not None else {}
        for f in self.fields:
            value = getattr(obj, f.name)
            if value is None and f.none_absent:
                continue
            out[f.name] = f.codec.dump(value, f.where)
        return out


def _derive(cls: type[Record], tag: str | None, name: str, label: str) -> None:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: a wire record must be a dataclass")
    cls.TAG, cls.NAME = tag, name
    cls._schema = Schema(cls, tag, name, label)
