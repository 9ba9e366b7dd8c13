"""The one-line status bar at the top of every screen: run, where the GPU is, phase, epoch, badges."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from gputravel.console.tui.widgets.text import esc, fit


@dataclass(frozen=True, slots=True)
class StatusSummary:
    screen: str
    status: str
    run_id: str | None = None
    where: str = "orchestrator"
    phase: str | None = None
    epoch: int = 0
    visit: str = ""
    badges: tuple[str, ...] = ()
    fleet: bool = False  # ``where`` names every GPU of a fleet


class StatusBar(Widget):
    """What the run is doing, in one line (no clock: the bar reads the same in a replay)."""

    DEFAULT_CSS = """
    StatusBar {
        height: 1;
        width: 1fr;
        padding: 0 1;
    }
    """

    summary: reactive[StatusSummary | None] = reactive(None)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)

    def watch_summary(self, summary: StatusSummary | None) -> None:
        first = summary.status.split()[0].rstrip(":") if summary is not None and summary.status else ""
        first = {"pausing...": "paused", "cancelling...": "cancelled", "died": "failed", "unknown": "failed"}.get(first, first)  # pending: its colour; an end with no final word: a failure's
        for status in ("idle", "running", "paused", "completed", "failed", "cancelled", "starting"):
            self.set_class(first == status, f"-{status}")

    def render(self) -> RenderResult:
        s = self.summary
        if s is None:
            return Content("gputravel")
        width = self.content_size.width or 120
        # 80 columns: the run id goes, the rest stays; wider, what does not fit goes in the same order, so the
        # badges (FOLLOW, READ-ONLY) always show
        line = self._line(s, narrow=width < 100)
        for narrow, run_id, tight, lean in ((False, False, False, 0), (True, False, False, 0),
                                            (True, False, True, 0), (True, False, True, 1), (True, False, True, 2)):
            if line.cell_length <= width:
                break
            line = self._line(s, narrow=narrow, run_id=run_id, tight=tight, lean=lean)
        return line

    def _line(self, s: StatusSummary, *, narrow: bool, run_id: bool = True, tight: bool = False,
              lean: int = 0) -> Content:
        """``tight``: the visit as ``3/6``, the holder in 8 columns; then ``lean`` 1 leaves the epoch out and 2
        the visit too (the travel panel shows both), before the badges (REPLAY 466/752, READ-ONLY) are cut."""
        status = s.status.upper()
        if narrow and status.startswith("PAUSED BEFORE "):
            status = "PAUSED@" + status.removeprefix("PAUSED BEFORE ")
        parts = [f"[b]{esc(s.screen)}[/b]", f"[b $accent]{esc(status)}[/]"]
        if s.run_id and run_id and not narrow:
            parts.append(f"run {esc(s.run_id)}")
        if s.visit and not (narrow and s.fleet) and lean < 2:  # a narrow fleet: its visits are on the travel screen
            visit = s.visit.split()[1] if tight and len(s.visit.split()) > 1 else (
                " ".join(s.visit.split()[:2]) if narrow else s.visit)  # narrow: "visit 2/3"; tight: "2/3"
            parts.append(esc(visit))
        if s.fleet:  # a fleet: every GPU where it is; each device counts its own epochs (its card shows them)
            if narrow:  # every GPU still shows: each holder's name cut to its share of ~22 columns
                gpus = s.where.split()
                where = " ".join(fit(g, max(6, 22 // max(1, len(gpus)))) for g in gpus)
                parts.append(f"◆ [b]{esc(fit(where, 24))}[/b]")
            else:
                parts.append(f"GPUs ◆ [b]{esc(s.where)}[/b]")
        else:
            if narrow:  # "◆ orch": the GPU's marker says what "GPU" did
                where = "orch" if s.where == "orchestrator" else fit(s.where, 8 if tight else 14)
                parts.append(f"◆ [b]{esc(where)}[/b]")
            else:
                parts.append(f"GPU ◆ [b]{esc(s.where)}[/b]")
        if s.phase:
            parts.append(f"[b]{esc(s.phase)}[/b]" if narrow else f"phase [b]{esc(s.phase)}[/b]")
        if not s.fleet and lean < 1:
            parts.append(f"ep {s.epoch}" if narrow else f"epoch {s.epoch}")
        badges = " ".join(f"[reverse $warning] {esc(_short(b) if narrow else b)} [/]" for b in s.badges)
        return Content.from_markup(" │ ".join(parts) + ("  " + badges if badges else ""))


def _short(badge: str) -> str:
    """A badge in 80 columns: its words before " · "."""
    short = badge.split(" · ")[0]
    return short
