"""A braille line plot: several series over a shared x axis, y labels, a legend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import esc

#: Dot bits of a braille cell, indexed [column][row].
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


@dataclass(frozen=True, slots=True)
class PlotSeries:
    label: str
    points: tuple[tuple[float, float], ...]
    token: str = "$primary"  # a theme token, never a colour


def braille_canvas(series: Sequence[PlotSeries], *, cols: int, rows: int,
                   x_range: tuple[float, float], y_range: tuple[float, float]) -> list[list[tuple[int, int]]]:
    """Cells as (bits, index of the series that drew last); lines join consecutive points."""
    cells = [[(0, -1) for _ in range(cols)] for _ in range(rows)]
    (x0, x1), (y0, y1) = x_range, y_range
    w, h = cols * 2, rows * 4
    xs = (x1 - x0) or 1.0
    ys = (y1 - y0) or 1.0

    def dot(px: int, py: int, idx: int) -> None:
        if 0 <= px < w and 0 <= py < h:
            cy, cx = py // 4, px // 2
            bits, _ = cells[cy][cx]
            cells[cy][cx] = (bits | _DOTS[px % 2][py % 4], idx)

    for idx, s in enumerate(series):
        prev: tuple[int, int] | None = None
        for x, y in s.points:
            px = round((x - x0) / xs * (w - 1))
            py = round((1.0 - (y - y0) / ys) * (h - 1))
            if prev is not None:
                steps = max(abs(px - prev[0]), abs(py - prev[1]), 1)
                for k in range(1, steps + 1):
                    dot(prev[0] + (px - prev[0]) * k // steps, prev[1] + (py - prev[1]) * k // steps, idx)
            else:
                dot(px, py, idx)
            prev = (px, py)
    return cells


class BraillePlot(Widget):
    """Series drawn with braille dots (2×4 per cell), so 60 columns resolve 120 steps."""

    DEFAULT_CSS = """
    BraillePlot {
        height: 1fr;
        min-height: 6;
        width: 1fr;
        padding: 0 1;
    }
    """

    series: reactive[tuple[PlotSeries, ...]] = reactive((), always_update=True)
    x_label: reactive[str] = reactive("step")

    def __init__(self, *, x_label: str = "step", id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.set_reactive(BraillePlot.x_label, x_label)

    def render(self) -> RenderResult:
        data = [s for s in self.series if s.points]
        if not data:
            return Content.from_markup("[$text-muted]no data yet[/]")
        width = max(12, (self.content_size.width or 60))
        height = max(3, (self.content_size.height or 10))
        label_w = 7
        cols, rows = width - label_w - 1, height - 3
        xs = [x for s in data for x, _ in s.points]
        ys = [y for s in data for _, y in s.points]
        x_range, y_range = (min(xs), max(xs)), (min(ys), max(ys))
        cells = braille_canvas(data, cols=cols, rows=rows, x_range=x_range, y_range=y_range)
        legend = "   ".join(f"[{s.token}]━━[/] {esc(s.label)}" for s in data)
        lines = [f"{' ' * (label_w + 1)}{legend}"]
        for r, row in enumerate(cells):
            y_label = f"{y_range[1]:>6.2f}" if r == 0 else f"{y_range[0]:>6.2f}" if r == rows - 1 else " " * 6
            out = []
            for bits, idx in row:
                ch = chr(0x2800 + bits) if bits else " "
                out.append(f"[{data[idx].token}]{ch}[/]" if bits else ch)
            lines.append(f"[$text-muted]{y_label}[/] ┤" + "".join(out))
        lo, hi = f"{x_range[0]:g}", f"{x_range[1]:g}"
        axis = f"{' ' * label_w}└{'─' * cols}"
        ticks = f"{' ' * (label_w + 1)}{lo}{' ' * max(1, cols - len(lo) - len(hi) - len(self.x_label) - 2)}" \
                f"{esc(self.x_label)}  {hi}"
        lines.append(axis)
        lines.append(ticks)
        return Content.from_markup("\n".join(lines[: height + 1]))
