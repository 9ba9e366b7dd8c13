"""A horizontal bar chart: one labelled bar per result."""

from __future__ import annotations

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import bar, esc


class BarChart(Widget):
    """``bars`` is ((label, value), ...); the longest bar is the largest value."""

    DEFAULT_CSS = """
    BarChart {
        height: auto;
        width: 1fr;
        padding: 0 1;
    }
    """

    bars: reactive[tuple[tuple[str, float], ...]] = reactive((), layout=True)
    unit: reactive[str] = reactive("")

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def watch_unit(self, unit: str) -> None:
        self.border_title = unit or None  # the unit once, above the bars

    def render(self) -> RenderResult:
        if not self.bars:
            return Content.from_markup("[$text-muted]nothing to chart yet[/]")
        label_w = min(28, max(len(label) for label, _ in self.bars))
        width = max(10, (self.content_size.width or 60) - label_w - 13)
        top = max((v for _, v in self.bars), default=0.0) or 1.0
        lines = [f"{esc(label[:label_w]):<{label_w}} {bar(v / top, width, token='$primary')} {_figure(v):>10}"
                 for label, v in self.bars]
        return Content.from_markup("\n".join(lines))


def _figure(v: float) -> str:
    """A bar's value: whole below a million, else with a thousands separator, never cut to an exponent."""
    if abs(v) >= 1e4:
        return f"{v:,.0f}"
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
