"""``Forward``: an object's attribute that lives on one of its parts.

The engine's state moved into its parts (``DeviceSession``, ``TrainingLog``, ``Checkpointer``, ``EventBus``,
``Itinerary``); the names callers used on the engine (``engine.client``, ``engine.records``,
``engine.sinks``, ...) stay as one-line forwards, read and written through to the part.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, overload

__all__ = ["Forward"]

T = TypeVar("T")


class Forward(Generic[T]):
    """``client = Forward[DeviceClient]("device")``: ``obj.client`` is ``obj.device.client`` (read and write);
    ``name`` when the part calls it otherwise (``Forward[int]("device", "restarts")``)."""

    __slots__ = ("name", "part")

    def __init__(self, part: str, name: str = "") -> None:
        self.part = part
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, obj: None, owner: type) -> Forward[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> Forward[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, self.part), self.name))

    def __set__(self, obj: object, value: T) -> None:
        part: Any = getattr(obj, self.part)
        setattr(part, self.name, value)
