"""Where the GPU is: the orchestrator on the left, the holders on the right, ◆ marks the GPU."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.widgets.text import esc

STATE_TOKENS = {"ready": "$success", "provisioning": "$accent", "returned": "$primary", "failed": "$error",
                "offline": "$text-disabled", "connecting": "$text-muted", "deploying": "$text-muted"}


@dataclass(frozen=True, slots=True)
class RouteView:
    holders: tuple[tuple[str, str], ...] = ()  # (name, state label)
    gpu_at: str = "orchestrator"
    phase: str | None = None


class RouteMap(Widget):
    """The orchestrator, the holders, and the GPU (◆) with whoever holds it now."""

    DEFAULT_CSS = """
    RouteMap {
        height: auto;
        min-height: 5;
        width: 1fr;
        padding: 0 1;
    }
    """

    view: reactive[RouteView] = reactive(RouteView, always_update=True, layout=True)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def render(self) -> RenderResult:
        v = self.view
        home = v.gpu_at == "orchestrator"
        gpu = "[b reverse $accent] ◆ GPU [/]"
        left = ["┌──────────────┐", "│ orchestrator │", "│ model·ledger │", "└──────────────┘"]
        rows = list(v.holders) or [("(no holders yet)", "offline")]
        lines = []
        for i in range(max(len(left), len(rows))):
            text = esc(left[i]) if i < len(left) else " " * len(left[0])
            text += f" {gpu}" if (home and i == 1) else " " * 8
            if i < len(rows):
                name, state = rows[i]
                token = STATE_TOKENS.get(state.split("(")[0], "$foreground")
                marker = f" {gpu}" if (not home and name == v.gpu_at) else ""
                text += f" ──▶ [b]{esc(name[:18]):<18}[/b] [{token}]{esc(state[:20])}[/]{marker}"
            lines.append(text)
        return Content.from_markup("\n".join(lines))
