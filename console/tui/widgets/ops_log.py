"""The operations log pane (like lazygit's command log): each remote operation as it happens."""

from __future__ import annotations

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import esc
from gputravel.console.view.model import OpLine

LEVEL_TOKENS = {"warn": "$warning", "error": "$error"}


def render_lines(lines: tuple[OpLine, ...] | list[OpLine]) -> str:
    out = []
    for line in lines:
        text = esc(line.render())
        token = LEVEL_TOKENS.get(line.level)
        out.append(f"[{token}]{text}[/]" if token else text)
    return "\n".join(out)


class OpsLog(Widget):
    """The last operations of the run; the newest line at the bottom."""

    DEFAULT_CSS = """
    OpsLog {
        height: 8;
        width: 1fr;
        padding: 0 1;
    }
    """

    lines: reactive[tuple[OpLine, ...]] = reactive((), always_update=True)
    #: what the empty log suggests: keys that work in this console (a replay, a read-only one offers fewer)
    hint: reactive[str] = reactive("[b]r[/b] runs, [b]space[/b] steps one phase")

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.border_title = "operations"

    def render(self) -> RenderResult:
        visible = max(1, self.content_size.height or 6)
        tail = self.lines[-visible:]
        if not tail:
            return Content.from_markup(f"[$text-muted]no operations yet{': ' + self.hint if self.hint else ''}[/]")
        return Content.from_markup(render_lines(tail))
