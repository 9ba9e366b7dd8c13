"""Where the GPU is: the orchestrator on the left, the holders on the right, ◆ marks the GPU."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.widgets.text import esc, fit

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
        rows = list(v.holders) or [("(no holders yet)", "offline")]
        if (self.content_size.width or 80) < 60:
            return Content.from_markup(self._compact(v, rows, self.content_size.width or 32))
        home = v.gpu_at == "orchestrator"
        gpu = "[b reverse $accent] ◆ GPU [/]"
        left = ["┌──────────────┐", "│ orchestrator │", "│ model·ledger │", "└──────────────┘"]
        name_w = min(24, max(len(name) for name, _ in rows))
        lines = []
        for i in range(max(len(left), len(rows))):
            text = esc(left[i]) if i < len(left) else " " * len(left[0])
            text += f" {gpu}" if (home and i == 1) else " " * 8
            if i < len(rows):
                name, state = rows[i]
                token = STATE_TOKENS.get(state.split("(")[0], "$foreground")
                marker = f" {gpu}" if (not home and name == v.gpu_at) else ""
                text += f" ──▶ [b]{esc(fit(name, name_w)):<{name_w}}[/b] [{token}]{esc(state[:20])}[/]{marker}"
            lines.append(text)
        return Content.from_markup("\n".join(lines))

    @staticmethod
    def _compact(v: RouteView, rows: list[tuple[str, str]], width: int) -> str:
        """Narrow terminals: one line for the orchestrator, one per holder, ◆ where the GPU is."""
        home = v.gpu_at == "orchestrator"
        gpu = "[b reverse $accent]◆[/]"
        lines = [f"[b]orchestrator[/b] {gpu if home else ''}"]
        state_w = 12
        name_w = max(6, min(max(len(n) for n, _ in rows), width - state_w - 8))
        for i, (name, state) in enumerate(rows):
            token = STATE_TOKENS.get(state.split("(")[0], "$foreground")
            branch = "└─▶" if i == len(rows) - 1 else "├─▶"
            marker = f" {gpu}" if (not home and name == v.gpu_at) else ""
            lines.append(f" {branch} [b]{esc(fit(name, name_w)):<{name_w}}[/b] "
                         f"[{token}]{esc(fit(state.split('(')[0], state_w))}[/]{marker}")
        return "\n".join(lines)
