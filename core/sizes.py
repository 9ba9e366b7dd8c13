"""Sizes as people type them (``512M``, ``10G``, ``1.5T``, ``64KB``) and buffer lists in MiB (``4,20,uncapped``),
read into numbers or refused as a ``ConfigError`` (``gputravel plan --holder-bytes``, ``bench travel
--buffer-mib``)."""

from __future__ import annotations

import math
import re

from gputravel.core.errors import ConfigError

__all__ = ["parse_buffer_list", "parse_size", "parse_sizes"]

_BINARY = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``512``, ``64K``, ``512M``, ``10G``, ``1.5T`` (K/M/G/T and KiB/MiB/... are powers of
    1024; ``KB``/``MB``/``GB``/``TB`` are powers of 1000). A bad or non-positive size is a ``ConfigError``."""
    if not isinstance(text, str):
        raise ConfigError(f"size {text!r} is not text")
    m = _SIZE_RE.match(text)
    if m is None:
        raise ConfigError(f"cannot read {text!r} as a size (examples: 512M, 10G, 1.5T)")
    number = float(m.group(1)) * (10.0 ** int(m.group(2)) if m.group(2) else 1.0)
    unit = m.group(3).lower()
    if unit in _BINARY:
        scale = _BINARY[unit]
    elif len(unit) == 3 and unit.endswith("ib") and unit[0] in _BINARY:
        scale = _BINARY[unit[0]]
    elif len(unit) == 2 and unit.endswith("b") and unit[0] in _BINARY:
        scale = 1000 ** "bkmgtp".index(unit[0])
    else:
        raise ConfigError(f"unknown size unit {m.group(3)!r} in {text!r} (use K, M, G, T, or KiB.., or KB..)")
    value = number * scale
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"size {text!r} must be at least one byte")
    return int(round(value))


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (``10G,20G,5G``); empty items are an error."""
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise ConfigError(f"{text!r}: expected a comma-separated list of sizes such as 10G,512M,1.5T")
    return [parse_size(t) for t in items]


def parse_buffer_list(text: str) -> list[float | None]:
    """Buffer sizes in MiB, comma-separated; ``uncapped`` (None) is one buffer holding a holder's whole data."""
    out: list[float | None] = []
    for raw in str(text).split(","):
        item = raw.strip().lower()
        if not item:
            raise ConfigError(f"{text!r}: an empty buffer size")
        if item in ("uncapped", "inf", "all"):
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"buffer size {raw.strip()!r} is neither a number of MiB nor 'uncapped'") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"buffer size {raw.strip()!r} must be a positive number of MiB")
        out.append(value)
    return out
