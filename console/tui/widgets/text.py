"""Small text helpers shared by the widgets: escaping, bars, sparklines, units. Colours only as $tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textual.markup import escape

from gputravel.core.telemetry.model import NA

__all__ = ["bar", "esc", "fit", "fmt_bytes", "fmt_num", "fmt_pct", "fmt_rate", "level_token", "spark"]

BLOCKS = "▁▂▃▄▅▆▇█"


def esc(value: Any) -> str:
    """Any value as markup-safe text (``NA`` reads ``N/A``)."""
    return escape(str(value))


def fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells: whole when it fits, else cut with an ellipsis (never silently)."""
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…" if width > 0 else ""


def level_token(fraction: float) -> str:
    """$success under 60 %, $warning under 85 %, $error above."""
    return "$success" if fraction < 0.6 else "$warning" if fraction < 0.85 else "$error"


def bar(fraction: float | None, width: int, *, token: str | None = None) -> str:
    """A horizontal bar as markup; ``None`` draws an empty, dimmed track."""
    width = max(1, width)
    if fraction is None:
        return f"[$text-disabled]{'╌' * width}[/]"
    fraction = max(0.0, min(1.0, fraction))
    full = round(fraction * width)
    colour = token or level_token(fraction)
    return f"[{colour}]{'█' * full}[/][$text-disabled]{'░' * (width - full)}[/]"


def spark(values: Sequence[float], width: int, *, lo: float | None = None, hi: float | None = None) -> str:
    """The last ``width`` values as a one-line block sparkline (plain text)."""
    if not values:
        return ""
    tail = list(values)[-width:]
    low = min(tail) if lo is None else lo
    high = max(tail) if hi is None else hi
    span = (high - low) or 1.0
    return "".join(BLOCKS[min(7, max(0, int((v - low) / span * 7.999)))] for v in tail)


def fmt_bytes(value: Any) -> str:
    if value is NA or value is None:
        return "N/A"
    n = float(value)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit != "KiB" else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(value: Any) -> str:
    if value is NA or value is None:
        return "N/A"
    n = float(value)
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB/s"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB/s"
    if n >= 1e3:
        return f"{n / 1e3:.0f} kB/s"
    return f"{n:.0f} B/s"


def fmt_num(value: Any, spec: str = ".0f", unit: str = "") -> str:
    if value is NA or value is None:
        return "N/A"
    return f"{format(value, spec)}{unit}"


def fmt_pct(value: Any) -> str:
    return fmt_num(value, ".0f", "%")
