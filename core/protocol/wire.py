"""One wire discipline: a message is a frozen dataclass whose fields declare their bounds, and ``to_wire`` /
``from_wire`` come from the declarations once.

Standard library only (the holder and the device speak it too). A field declares what it may hold with
:func:`bounds` in its ``field(metadata=...)`` and a :class:`Spec`: :class:`Int` (a range), :class:`Float`,
:class:`Bool`, :class:`Flag` (true/false or 1/0), :class:`Str` (a maximum length, optionally choices), :class:`Hex`
(an exact or maximum number of hex digits), :class:`Json` (free-form, bounded in depth and size), :class:`Opt`
(the spec or ``None``), :class:`ListOf` and :class:`MapOf` (at most so many items, each checked), :class:`TupleOf`
(a fixed-length list, held as a tuple) and :class:`Nested` (another :class:`WireMessage`)::

    @dataclass(frozen=True, slots=True)
    class BufferDigest(WireMessage):
        sha256: str = field(metadata=bounds(Hex(64)))
        offset: int = field(metadata=bounds(Int(0, MAX_U64)))
        length: int = field(default=0, metadata=bounds(Int(0, MAX_U64)))

``from_wire`` takes a peer's decoded JSON object, checks every declared field (missing, wrong type, out of
bounds: :class:`WireFormatError` naming the message and the field; its code is the class's ``WIRE_CODE``,
``frame`` for the holder link's :class:`FrameMessage`), then the checks that span fields
(:meth:`WireMessage.validated`); keys it does not declare are ignored (a newer peer may add some). ``to_wire``
gives the JSON-ready dict. ``bounds`` also takes a field's ``wire`` name where it differs from the attribute
and ``sparse=True`` for a field left off the wire while it holds its default. A field declared without a spec
is refused when the message is first used (``TypeError``: a bug, not input).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, Self

from gputravel.core.protocol.errors import WireFormatError

__all__ = ["MAX_FLOAT", "MAX_U32", "MAX_U64", "Bool", "Flag", "Float", "FrameMessage", "Hex", "Int", "Json", "ListOf",
           "MapOf", "Nested", "Opt", "Raw", "Spec", "Str", "TupleOf", "WireFormatError", "WireMessage", "bounds"]

MAX_U32 = 2**32 - 1
MAX_U64 = 2**64 - 1
#: the largest finite float: ``Float(0.0, MAX_FLOAT)`` refuses infinity as well as NaN
MAX_FLOAT = sys.float_info.max
_SPEC = "gputravel.wire"
_NAME = "gputravel.wire.name"
_SPARSE = "gputravel.wire.sparse"


class Spec:
    """What one field may hold: :meth:`check` a peer's value (returning it as the field holds it) and
    :meth:`dump` the field's value for the wire."""

    __slots__ = ()

    def check(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return value


@dataclass(frozen=True, slots=True)
class Int(Spec):
    lo: int = 0
    hi: int = MAX_U64

    def check(self, value: Any, where: str) -> int:
        if type(value) is not int:
            raise WireFormatError(f"{where}: expected an integer, got {type(value).__name__}", field=where)
        if not self.lo <= value <= self.hi:
            raise WireFormatError(f"{where}: {value} is outside {self.lo}..{self.hi}", field=where)
        return value


@dataclass(frozen=True, slots=True)
class Float(Spec):
    """A number (an integer is taken as a float); ``lo``/``hi`` bound it; NaN passes only when ``nan``."""

    lo: float = -math.inf
    hi: float = math.inf
    nan: bool = False

    def check(self, value: Any, where: str) -> float:
        if type(value) not in (int, float):
            raise WireFormatError(f"{where}: expected a number, got {type(value).__name__}", field=where)
        number = float(value)
        if math.isnan(number):
            if not self.nan:
                raise WireFormatError(f"{where}: NaN is not a value here", field=where)
            return number
        if not self.lo <= number <= self.hi:
            raise WireFormatError(f"{where}: {number} is outside {self.lo}..{self.hi}", field=where)
        return number


@dataclass(frozen=True, slots=True)
class Bool(Spec):
    def check(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            raise WireFormatError(f"{where}: expected true or false, got {type(value).__name__}", field=where)
        return value


@dataclass(frozen=True, slots=True)
class Flag(Spec):
    """true/false, or 1/0 (older peers send flags as integers); ``as_int``: written as 1/0."""

    as_int: bool = False

    def check(self, value: Any, where: str) -> bool:
        if type(value) is bool or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise WireFormatError(f"{where}: expected a flag (true/false, 1/0), got {str(value)[:20]!r}", field=where)

    def dump(self, value: Any) -> Any:
        return int(value) if self.as_int else bool(value)


@dataclass(frozen=True, slots=True)
class Str(Spec):
    """A string of at most ``max_len`` characters (and one of ``choices`` when given)."""

    max_len: int = 256
    choices: frozenset[str] | None = None

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str:
            raise WireFormatError(f"{where}: expected a string, got {type(value).__name__}", field=where)
        if len(value) > self.max_len:
            raise WireFormatError(f"{where}: {len(value)} characters, at most {self.max_len}", field=where)
        if self.choices is not None and value not in self.choices:
            raise WireFormatError(f"{where}: {value[:40]!r} is not one of {sorted(self.choices)}", field=where)
        return value


@dataclass(frozen=True, slots=True)
class Hex(Spec):
    """Lower- or upper-case hex digits: exactly ``length`` of them, or (``length=None``) an even number of at
    most ``max_len`` (``empty``: "" is allowed too, as "none")."""

    length: int | None = None
    max_len: int = 128
    empty: bool = False

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str:
            raise WireFormatError(f"{where}: expected hex digits, got {type(value).__name__}", field=where)
        if value == "" and self.empty:
            return value
        if self.length is not None and len(value) != self.length:
            raise WireFormatError(f"{where}: {len(value)} hex digits, expected {self.length}", field=where)
        if self.length is None and (not value or len(value) % 2 or len(value) > self.max_len):
            raise WireFormatError(f"{where}: {len(value)} hex digits, expected an even number up to "
                                  f"{self.max_len}", field=where)
        try:
            bytes.fromhex(value)
        except ValueError:
            raise WireFormatError(f"{where}: not hex digits", field=where) from None
        return value


@dataclass(frozen=True, slots=True)
class Opt(Spec):
    """``spec``, or ``None``."""

    spec: Spec

    def check(self, value: Any, where: str) -> Any:
        return None if value is None else self.spec.check(value, where)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.spec.dump(value)


@dataclass(frozen=True, slots=True)
class ListOf(Spec):
    """A list of at most ``max_len`` items, each ``item``."""

    item: Spec
    max_len: int

    def check(self, value: Any, where: str) -> list[Any]:
        if type(value) is not list:
            raise WireFormatError(f"{where}: expected a list, got {type(value).__name__}", field=where)
        if len(value) > self.max_len:
            raise WireFormatError(f"{where}: {len(value)} items, at most {self.max_len}", field=where)
        return [self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value)]

    def dump(self, value: Any) -> Any:
        return [self.item.dump(v) for v in value]


@dataclass(frozen=True, slots=True)
class TupleOf(Spec):
    """A list of exactly ``len(items)`` values, each checked by its spec, held as a tuple (``[start, length]``)."""

    items: tuple[Spec, ...]

    def check(self, value: Any, where: str) -> tuple[Any, ...]:
        if type(value) is not list or len(value) != len(self.items):
            raise WireFormatError(f"{where}: expected a list of {len(self.items)} values", field=where)
        return tuple(spec.check(v, f"{where}[{i}]") for i, (spec, v) in enumerate(zip(self.items, value, strict=True)))

    def dump(self, value: Any) -> Any:
        return [spec.dump(v) for spec, v in zip(self.items, value, strict=True)]


@dataclass(frozen=True, slots=True)
class MapOf(Spec):
    """An object of at most ``max_len`` entries: keys strings of at most ``key_len`` characters, values ``value``."""

    value: Spec
    max_len: int
    key_len: int = 64

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise WireFormatError(f"{where}: expected an object, got {type(value).__name__}", field=where)
        if len(value) > self.max_len:
            raise WireFormatError(f"{where}: {len(value)} entries, at most {self.max_len}", field=where)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str or len(k) > self.key_len:
                raise WireFormatError(f"{where}: a key that is not a string of at most {self.key_len} characters",
                                      field=where)
            out[k] = self.value.check(v, f"{where}.{k[:32]}")
        return out

    def dump(self, value: Any) -> Any:
        return {k: self.value.dump(v) for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class Json(Spec):
    """Free-form JSON (a report's detail that other parts type): nested at most ``max_depth`` deep, at most
    ``max_items`` values in all, strings at most ``max_str`` characters."""

    max_depth: int = 4
    max_items: int = 4096
    max_str: int = 4096

    def check(self, value: Any, where: str) -> Any:
        budget = [self.max_items]
        self._walk(value, where, 0, budget)
        return value

    def _walk(self, value: Any, where: str, depth: int, budget: list[int]) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise WireFormatError(f"{where}: more than {self.max_items} values", field=where)
        if value is None or type(value) in (bool, int, float):
            return
        if type(value) is str:
            if len(value) > self.max_str:
                raise WireFormatError(f"{where}: a string of {len(value)} characters, at most {self.max_str}",
                                      field=where)
            return
        if type(value) not in (list, dict):
            raise WireFormatError(f"{where}: {type(value).__name__} is not JSON", field=where)
        if depth >= self.max_depth:
            raise WireFormatError(f"{where}: nested deeper than {self.max_depth}", field=where)
        if type(value) is dict:
            for k, v in value.items():
                if type(k) is not str:
                    raise WireFormatError(f"{where}: a key that is not a string", field=where)
                self._walk(v, where, depth + 1, budget)
        else:
            for v in value:
                self._walk(v, where, depth + 1, budget)


@dataclass(frozen=True, slots=True)
class Nested(Spec):
    """Another message, checked by its own declarations."""

    cls: type[WireMessage]

    def check(self, value: Any, where: str) -> WireMessage:
        return self.cls.from_wire(value, where=where)

    def dump(self, value: Any) -> Any:
        return value.to_wire()


@dataclass(frozen=True, slots=True)
class Raw(Spec):
    """A value with its own typed reader and writer (``load`` raises :class:`WireFormatError` itself, or a
    ``ProtocolError`` of its own kind): for a wire type that predates this module, such as a key."""

    load: Callable[[Any], Any]
    save: Callable[[Any], Any]

    def check(self, value: Any, where: str) -> Any:
        return self.load(value)

    def dump(self, value: Any) -> Any:
        return self.save(value)


def bounds(spec: Spec, *, wire: str | None = None, sparse: bool = False) -> dict[str, object]:
    """A field's metadata declaring its wire bounds: ``field(metadata=bounds(Int(0, 9)))`` (a ``default`` or
    ``default_factory`` makes it optional on the wire). Plain ``dataclasses.field``, so type checkers see
    which fields are required. ``wire``: its name on the wire when not the attribute's; ``sparse``: left off
    the wire while it holds its default."""
    return {_SPEC: spec, _NAME: wire, _SPARSE: sparse}


@dataclass(frozen=True, slots=True)
class _Decl:
    """One field as the wire sees it: attribute, wire name, spec, and its default (``required``: none)."""

    attr: str
    wire: str
    spec: Spec
    required: bool
    sparse: bool
    default: Any


_DECLS: dict[type, tuple[_Decl, ...]] = {}


def _decls(cls: type[WireMessage]) -> tuple[_Decl, ...]:
    found = _DECLS.get(cls)
    if found is None:
        decls = []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get(_SPEC)
            if not isinstance(spec, Spec):
                raise TypeError(f"{cls.__name__}.{f.name} declares no wire bounds (field(metadata=bounds(Spec)))")
            required = f.default is MISSING and f.default_factory is MISSING
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            decls.append(_Decl(f.name, f.metadata.get(_NAME) or f.name, spec, required,
                               bool(f.metadata.get(_SPARSE)), None if required else default))
        found = _DECLS[cls] = tuple(decls)
    return found


class WireMessage:
    """The base of a message: a frozen dataclass whose every field declares its :func:`bounds`."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]
    #: the code of the error a malformed message raises (the holder link's messages say ``frame``)
    WIRE_CODE: ClassVar[str] = WireFormatError.code

    def to_wire(self) -> dict[str, Any]:
        return self.wire_fields()

    def wire_fields(self) -> dict[str, Any]:
        """Every declared field as the wire has it, a sparse one only while not at its default."""
        out: dict[str, Any] = {}
        for d in _decls(type(self)):
            value = getattr(self, d.attr)
            if not (d.sparse and value == d.default):
                out[d.wire] = d.spec.dump(value)
        return out

    def validated(self) -> Self:
        """Checks that span fields, run by ``from_wire`` after every field's own (raising a ``FrameError``): the
        message, or its normal form. This one checks nothing more."""
        return self

    @classmethod
    def from_wire(cls, head: Any, *, where: str | None = None) -> Self:
        """The message in ``head`` (a peer's decoded JSON object), every declared field checked, then
        :meth:`validated`.

        Raises:
            WireFormatError: not an object, a required field missing, or a field of the wrong type or out of
                its bounds (the error names the message and the field; its code is ``WIRE_CODE``).
        """
        return cls.checked(head, where=where)

    @classmethod
    def checked(cls, head: Any, *, where: str | None = None) -> Self:
        """``from_wire``'s checks (a message that checks more overrides ``from_wire`` and calls this, or
        overrides :meth:`validated`: ``super()`` does not reach past a ``slots=True`` dataclass)."""
        name = where or cls.__name__
        try:
            if not isinstance(head, Mapping):
                raise WireFormatError(f"{name}: expected an object, got {type(head).__name__}", field=name)
            values: dict[str, Any] = {}
            for d in _decls(cls):
                if d.wire in head:
                    values[d.attr] = d.spec.check(head[d.wire], f"{name}.{d.wire}")
                elif d.required:
                    raise WireFormatError(f"{name}.{d.wire}: missing", field=f"{name}.{d.wire}")
            return cls(**values).validated()
        except WireFormatError as exc:
            exc.code = cls.WIRE_CODE  # the outermost message's code: who charges the sender knows it
            raise


class FrameMessage(WireMessage):
    """A message of the holder link or the data connection: malformed, it is a ``FrameError`` of code ``frame``
    (a ``WireFormatError`` naming the field), charged to whoever sent it as every malformed frame is."""

    __slots__ = ()
    WIRE_CODE: ClassVar[str] = "frame"
