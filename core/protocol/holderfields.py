"""Field readers for the holder link's typed messages (``holderlink``, ``holderattest``): each raises
``FrameError`` naming the message and the field, so nothing reads a peer's header by hand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputravel.core.protocol.errors import FrameError

__all__ = ["POLICY_SOURCES"]

_U64 = (1 << 64) - 1
#: a readable ceiling for text fields (names, reasons, versions): a header is at most 16 KiB anyway
_MAX_TEXT = 4096

_MISSING: Any = object()


def _get(h: Mapping[str, Any], what: str, name: str, default: Any) -> Any:
    if not isinstance(h, Mapping):
        raise FrameError(f"{what} header is not an object")
    value = h.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise FrameError(f"{what} lacks {name!r}")
        return default
    return value


def _int(h: Mapping[str, Any], what: str, name: str, *, lo: int = 0, hi: int = _U64, default: Any = _MISSING) -> Any:
    value = _get(h, what, name, default)
    if value is default and default is not _MISSING:
        return value
    if type(value) is not int:  # bool, float and str are refused: the protocol sends integers
        raise FrameError(f"{what} {name!r} must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise FrameError(f"{what} {name!r} = {value} outside {lo}..{hi}")
    return value


def _str(h: Mapping[str, Any], what: str, name: str, *, default: Any = _MISSING, max_len: int = _MAX_TEXT) -> Any:
    value = _get(h, what, name, default)
    if value is default and default is not _MISSING:
        return value
    if not isinstance(value, str):
        raise FrameError(f"{what} {name!r} must be a string, not {type(value).__name__}")
    if len(value) > max_len:
        raise FrameError(f"{what} {name!r} of {len(value)} characters exceeds {max_len}")
    return value


def _hex(h: Mapping[str, Any], what: str, name: str, *, nbytes: int | None = None, default: Any = _MISSING) -> Any:
    value = _str(h, what, name, default=default)
    if value is default and default is not _MISSING:
        return value
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise FrameError(f"{what} {name!r} is not hex") from None
    if nbytes is not None and len(raw) != nbytes:
        raise FrameError(f"{what} {name!r} must be {nbytes} bytes, not {len(raw)}")
    return value


def _flag(h: Mapping[str, Any], what: str, name: str) -> bool:
    value = _get(h, what, name, False)
    if type(value) is bool or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise FrameError(f"{what} {name!r} must be a flag (true/false, 1/0)")


#: who chose what an attesting agent checks: the holder itself (``holder serve``) or the orchestrator (``--attest-policy``)
POLICY_SOURCES = ("holder", "orchestrator")


def _source(h: Mapping[str, Any], what: str) -> str | None:
    value: str | None = _str(h, what, "policy_source", default=None, max_len=16)
    if value is not None and value not in POLICY_SOURCES:
        raise FrameError(f"{what} 'policy_source' must be one of {list(POLICY_SOURCES)}, not {value!r}")
    return value
