"""The phase timeline: one row per visit, one mark per protocol phase, with the visit's receipts."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import esc, fit
from gputravel.console.view.model import VisitView, gpu_label
from gputravel.core.phases import VISIT_PHASES

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
    """Every visit's phases: ■ done, ▶ running, ‖ paused before, ✗ failed; ● marks a breakpoint. A fleet's
    visits name their GPU."""

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
        compact = (self.content_size.width or 120) < 100  # 80-column terminals: narrower marks, no key column
        name_w = min(24, max([6, *(len(x.holder) for x in v.visits)]))
        if compact:
            name_w = min(name_w, 10)
        cell = 4 if compact else 5
        heads = "".join(f"{'[$error]●[/]' if str(p) in v.breakpoints else ' '}{PHASE_SHORT[str(p)]}"
                        + " " * (cell - 4) for p in VISIT_PHASES)
        key_head = "" if compact else f" {'key fp':<8} "
        gpu_w = max([0, *(len(gpu_label(x.gpu)) for x in v.visits if x.gpu is not None)])  # a fleet's visits
        gpu_head = f"{'gpu':<{gpu_w}} " if gpu_w else ""
        lines = [f"[b]{'#':>2}  {gpu_head}{'holder':<{name_w}} {'ep':>3} {heads}{key_head} int scr  outcome[/b]"]
        if not v.visits:
            lines.append(f"[$text-muted]    no visits yet ({v.planned or '?'} planned)[/]")
        running = [x for x in v.visits if x.outcome == "running"]
        for visit in v.visits:
            marks = []
            for phase in VISIT_PHASES:
                status = visit.phases[str(phase)].status
                paused_here = (status == "pending" and v.paused_before == str(phase) and bool(running)
                               and visit is running[-1])
                mark = "[b $warning]‖[/]" if paused_here else MARKS.get(status, "?")
                marks.append(f"  {mark} " + " " * (cell - 4))
            token = OUTCOME_TOKENS.get(visit.outcome, "$foreground")
            outcome = visit.outcome + (f" ({visit.failed_phase})" if visit.failed_phase else "")
            if visit.attempt > 1:
                outcome += f" · attempt {visit.attempt}" if not compact else f" #{visit.attempt}"
            key = "" if compact else f" {esc((visit.key_fp or '-')[:8]):<8} "
            gpu = f"{gpu_label(visit.gpu) if visit.gpu is not None else '-':<{gpu_w}} " if gpu_w else ""
            lines.append(
                f"{visit.visit + 1:>2}  {gpu}{esc(fit(visit.holder, name_w)):<{name_w}} {visit.epoch:>3} "
                f"{''.join(marks)}"
                f"{key}  {receipt(visit.integrity_ok)}   {receipt(visit.scrub_verified)}  "
                f"[{token}]{esc(outcome)}[/]"
            )
        return Content.from_markup("\n".join(lines))
