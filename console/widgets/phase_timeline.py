"""The phase timeline: one row per visit, one mark per protocol phase, with the visit's receipts."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.view_model import VisitView
from gputravel.console.widgets.text import esc
from gputravel.core.travel.phases import VISIT_PHASES

PHASE_SHORT = {"ATTEST": "ATT", "HANDOFF": "HND", "PROVISION": "PRV", "RETURN": "RET", "VERIFY": "VER",
               "TRAIN": "TRN", "SCRUB": "SCR", "ROTATE": "ROT"}
MARKS = {"ok": "[$success]■[/]", "running": "[b $accent]▶[/]", "pending": "[$text-disabled]·[/]",
         "failed": "[b $error]✗[/]", "cancelled": "[$warning]–[/]"}
OUTCOME_TOKENS = {"done": "$success", "failed": "$error", "cancelled": "$warning", "running": "$accent"}


def receipt(value: bool | None) -> str:
    return "[$text-disabled]·[/]" if value is None else ("[$success]✓[/]" if value else "[$error]✗[/]")


@dataclass(frozen=True, slots=True)
class TimelineView:
    visits: tuple[VisitView, ...] = ()
    planned: int = 0
    paused_before: str | None = None
    breakpoints: frozenset[str] = frozenset()


class PhaseTimeline(Widget):
    """Every visit's phases: ■ done, ▶ running, ‖ paused before, ✗ failed; ● marks a breakpoint."""

    DEFAULT_CSS = """
    PhaseTimeline {
        height: auto;
        width: 1fr;
        padding: 0 1;
    }
    """

    view: reactive[TimelineView] = reactive(TimelineView, always_update=True, layout=True)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def render(self) -> RenderResult:
        v = self.view
        heads = "".join(f"{'[$error]●[/]' if str(p) in v.breakpoints else ' '}{PHASE_SHORT[str(p)]} " for p in VISIT_PHASES)
        lines = [f"[b]{'#':>2}  {'holder':<18} {'ep':>3} {heads} {'key fp':<8}  int scr  outcome[/b]"]
        if not v.visits:
            lines.append(f"[$text-muted]    no visits yet ({v.planned or '?'} planned)[/]")
        running = [x for x in v.visits if x.outcome == "running"]
        for visit in v.visits:
            marks = []
            for phase in VISIT_PHASES:
                status = visit.phases[str(phase)].status
                paused_here = (status == "pending" and v.paused_before == str(phase) and bool(running)
                               and visit is running[-1])
                marks.append("  [b $warning]‖[/]  " if paused_here else f"  {MARKS.get(status, '?')}  ")
            token = OUTCOME_TOKENS.get(visit.outcome, "$foreground")
            outcome = visit.outcome + (f" ({visit.failed_phase})" if visit.failed_phase else "")
            if visit.attempt > 1:
                outcome += f" · attempt {visit.attempt}"
            lines.append(
                f"{visit.visit + 1:>2}  {esc(visit.holder[:18]):<18} {visit.epoch:>3} {''.join(marks)} "
                f"{esc((visit.key_fp or '-')[:8]):<8}   {receipt(visit.integrity_ok)}   {receipt(visit.scrub_verified)}  "
                f"[{token}]{esc(outcome)}[/]"
            )
        return Content.from_markup("\n".join(lines))
