"""The one JSON decoder for a peer's bytes: bounded in size and in nesting depth.

Every decoder of bytes another party sent (a frame's header, a holder-link message, a device answer's
JSON payload, a stream's trailer) goes through ``loads_bounded``. Python's ``json`` recurses once per
``[`` or ``{``: 8,000 of them in a 16 KiB header raise ``RecursionError``, which is no ``ValueError``
and escaped every handler as an internal bug. Here the depth is measured before ``json`` runs, in C for
every ordinary header (fewer brackets than the limit cannot nest deeper than it) and by one pass over
the brackets outside strings otherwise, so a hostile header costs its length, never the stack.

Failures are ``FrameError`` (code ``frame``): the caller charges it to whoever sent the bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from gputravel.core.protocol.errors import FrameError

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth", "loads_bounded", "loads_object"]

#: The deepest nesting a peer's JSON may have. The protocol's own messages nest at most 3 levels (a
#: HANDOFF's key inside the header, a DONE's stages); the rest is room for fields added later.
MAX_JSON_DEPTH = 32
#: The largest JSON text accepted where the caller names no smaller limit (a frame header is 16 KiB).
MAX_JSON_BYTES = 1024 * 1024

#: a complete JSON string (escapes included): brackets inside strings do not nest anything
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: brackets as +1 / -1 steps (everything else deleted by ``bytes.translate``)
_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _depths(data: bytes) -> Iterator[int]:
    """The nesting depth after each bracket outside JSON strings."""
    steps = _STRING.sub(b"", data).translate(_OPEN_CLOSE, _NOT_BRACKETS)
    return accumulate(1 if s == 1 else -1 for s in steps)


def json_depth(raw: bytes | bytearray | memoryview) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``raw`` outside JSON strings (0 for a scalar).

    For invalid JSON (an unterminated string) it may count too deep, never too shallow."""
    data = bytes(raw)
    if data.count(b"[") + data.count(b"{") == 0:
        return 0
    return max(0, max(_depths(data), default=0))


def loads_bounded(raw: bytes | bytearray | memoryview, *, max_bytes: int = MAX_JSON_BYTES,
                  max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """Decode a peer's UTF-8 JSON text, or raise ``FrameError`` (too large, nested too deep, not UTF-8,
    not JSON). ``what`` names the text in the error (``"header"``, ``"HANDOFF"``)."""
    n = len(raw)
    if n > max_bytes:
        raise FrameError(f"{what} of {n} bytes exceeds the {max_bytes}-byte limit")
    data = bytes(raw)
    # cheap first: fewer brackets than the limit cannot nest deeper than it (C-speed counts, no scan)
    # else one pass over the brackets outside strings, which stops at the first level too deep
    if data.count(b"[") + data.count(b"{") > max_depth and any(d > max_depth for d in _depths(data)):
        raise FrameError(f"{what} nests deeper than the {max_depth} levels allowed")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # cannot happen within the depth limit; kept so it can never escape as a bug
        raise FrameError(f"{what} nests too deeply to decode") from None


def loads_object(raw: bytes | bytearray | memoryview, *, max_bytes: int = MAX_JSON_BYTES,
                 max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> dict[str, Any]:
    """``loads_bounded`` for text that must be a JSON object."""
    value = loads_bounded(raw, max_bytes=max_bytes, max_depth=max_depth, what=what)
    if not isinstance(value, dict):
        raise FrameError(f"{what} is not a JSON object")
    return value
