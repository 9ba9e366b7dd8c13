"""A horizontal bar chart: one labelled bar per result."""

from __future__ import annotations

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.widgets.text import bar, esc


class BarChart(Widget):
    """``bars`` is ((label, value), ...); the longest bar is the largest value."""

    DEFAULT_CSS = """
    BarChart {
        height: auto;
        width: 1fr;
        padding: 0 1;
    }
    """

    bars: reactive[tuple[tuple[str, float], ...]] = reactive(())
    unit: reactive[str] = reactive("")

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def render(self) -> RenderResult:
        if not self.bars:
            return Content.from_markup("[$text-muted]no results yet[/]")
        label_w = min(28, max(len(label) for label, _ in self.bars))
        width = max(10, (self.content_size.width or 60) - label_w - 16)
        top = max((v for _, v in self.bars), default=0.0) or 1.0
        lines = [f"{esc(label[:label_w]):<{label_w}} {bar(v / top, width, token='$primary')} {v:>10.4g} {esc(self.unit)}"
                 for label, v in self.bars]
        return Content.from_markup("\n".join(lines))
