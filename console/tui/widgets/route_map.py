"""Where the GPU is: the orchestrator on the left, the holders on the right, ◆ marks the GPU.

A fleet has one marker per GPU, labelled with it (``◆ GPU1``), beside whoever holds that GPU now."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import esc, fit

STATE_TOKENS = {"ready": "$success", "provisioning": "$accent", "returned": "$primary", "failed": "$error",
                "offline": "$text-disabled", "connecting": "$text-muted", "deploying": "$text-muted"}


@dataclass(frozen=True, slots=True)
class RouteView:
    holders: tuple[tuple[str, str], ...] = ()  # (name, state label)
    gpu_at: str = "orchestrator"
    phase: str | None = None
    gpus: tuple[tuple[str, str], ...] = ()  # a fleet: (label, where that GPU is), in rank order


def _at(v: RouteView) -> list[tuple[str, str]]:
    """(label, where) of every GPU on the route: a fleet's GPUs, or the one GPU (label "GPU")."""
    return list(v.gpus) or [("GPU", v.gpu_at)]


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
        at = _at(v)
        home = [label for label, where in at if where == "orchestrator"]
        first = 1 if len(home) == 1 else 0  # one GPU at home sits beside "orchestrator", several stack down
        left = ["┌──────────────┐", "│ orchestrator │", "│ model·ledger │", "└──────────────┘"]
        cell = max(len(label) for label, _ in at) + 4  # " ◆ GPU1 "
        name_w = min(24, max(len(name) for name, _ in rows))
        lines = []
        for i in range(max(len(left), len(rows), first + len(home))):
            text = esc(left[i]) if i < len(left) else " " * len(left[0])
            j = i - first
            text += f" {_marker(home[j])}" if 0 <= j < len(home) else " " * (cell + 1)
            if i < len(rows):
                name, state = rows[i]
                token = STATE_TOKENS.get(state.split("(")[0], "$foreground")
                markers = "".join(f" {_marker(label)}" for label, where in at if where == name)
                text += f" ──▶ [b]{esc(fit(name, name_w)):<{name_w}}[/b] [{token}]{esc(state[:20])}[/]{markers}"
            lines.append(text)
        return Content.from_markup("\n".join(lines))

    @staticmethod
    def _compact(v: RouteView, rows: list[tuple[str, str]], width: int) -> str:
        """Narrow terminals: one line for the orchestrator, one per holder, ◆ where the GPU is (◆1: a fleet's
        GPU1)."""
        fleet = bool(v.gpus)
        at = _at(v)

        def marks(where: str) -> str:
            here = [label for label, w in at if w == where]
            if not here:
                return ""
            if not fleet:
                return "[b reverse $accent]◆[/]"
            if len(here) > 4:  # many GPUs at home: a count, not a row of marks
                return f"[b reverse $accent]◆×{len(here)}[/]"
            return " ".join(f"[b reverse $accent]◆{label.removeprefix('GPU')}[/]" for label in here)

        lines = [f"[b]orchestrator[/b] {marks('orchestrator')}"]
        state_w = 12 if not fleet else 9
        name_w = max(6, min(max(len(n) for n, _ in rows), width - state_w - (8 if not fleet else 9)))
        for i, (name, state) in enumerate(rows):
            token = STATE_TOKENS.get(state.split("(")[0], "$foreground")
            branch = "└─▶" if i == len(rows) - 1 else "├─▶"
            marker = f" {marks(name)}" if marks(name) else ""
            lines.append(f" {branch} [b]{esc(fit(name, name_w)):<{name_w}}[/b] "
                         f"[{token}]{esc(fit(state.split('(')[0], state_w))}[/]{marker}")
        return "\n".join(lines)


def _marker(label: str) -> str:
    """One GPU on the route: ``◆ GPU`` (the one GPU) or ``◆ GPU1`` (a fleet's)."""
    return f"[b reverse $accent] ◆ {esc(label)} [/]"
