"""The Travel screen: where the GPU is, every visit's phases, the key epoch, the receipts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.containers import Horizontal, VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.widgets.phase_timeline import PhaseTimeline, TimelineView, receipt
from gputravel.console.tui.widgets.route_map import RouteMap, RouteView
from gputravel.console.tui.widgets.table_filter import TableFilter, row_matches
from gputravel.console.tui.widgets.text import esc, fit
from gputravel.console.view.model import DeviceView, RunState, VisitView, gpu_label


class TravelScreen(ConsoleScreen):
    """The GPU's journey: the route, the phase timeline of every visit, keys and receipts."""

    SCREEN_NAME = "travel"
    HELP = ("The GPU travels orchestrator → holder → orchestrator once per visit. Each row of the timeline is a "
            "visit; each mark a phase (■ done, ▶ running, ‖ paused before, ✗ failed; ● a breakpoint). "
            "int/scr are the visit's receipts: code and model verified unchanged after the holder returned, "
            "buffer scrubbed and read back as zero.")
    FLEET_HELP = ("A fleet (gputravel run --gpus N) has one ◆ per GPU on the route (◆ GPU1; ◆1 in 80 columns), "
                  "one line per GPU in the panel and a gpu column in the timeline. torchrun drives it; the console "
                  "only watches.")

    def compose_body(self) -> Iterable[Widget]:
        yield Horizontal(RouteMap(id="route-map"), Static(id="visit-detail"), id="travel-top")
        yield TableFilter(placeholder="filter visits by holder or outcome (enter keeps, escape clears)",
                          id="timeline-filter")
        yield VerticalScroll(PhaseTimeline(id="phase-timeline"), id="timeline-scroll")

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        holders = tuple((h.name, h.state_label) for h in state.holders.values())
        at = {d.gpu: d.at for d in state.devices()}  # a fleet's GPUs; one without an event yet is at home
        gpus = tuple((gpu_label(r), at.get(r, "orchestrator")) for r in sorted(set(range(state.fleet_size)) | set(at)))
        self.query_one(RouteMap).view = RouteView(holders=holders, gpu_at=state.gpu_at, phase=state.current_phase,
                                                  gpus=gpus)
        visits = tuple(v for v in state.visits.values()
                       if row_matches(self.needle, (v.holder, v.outcome, v.failed_phase or "", f"#{v.visit + 1}",
                                                    *((gpu_label(v.gpu), v.device or "") if v.gpu is not None
                                                      else ()))))
        if state.fleet:  # the GPUs run their visits side by side: rows by visit, then attempt
            visits = tuple(sorted(visits, key=lambda v: (v.visit, v.attempt)))
        self.query_one(PhaseTimeline).view = TimelineView(
            visits=visits, planned=state.visits_planned, paused_before=state.paused_before,
            breakpoints=frozenset(state.breakpoints))
        wide = self.app.size.width >= 150  # the detail panel has room for a whole holder name
        narrow = self.app.size.width < 110  # ... or ~44 columns (80x24): every line in its short form
        self.query_one("#visit-detail", Static).update(
            self._detail(state, {**context, "name_w": 28 if wide else 14, "narrow": narrow}))

    @staticmethod
    def _detail(state: RunState, context: dict[str, Any]) -> str:
        if state.fleet:
            return _fleet_detail(state, context)
        done = [v for v in state.visits.values() if v.ended]
        last = done[-1] if done else None
        current = state.visit(state.current_visit)
        lines = [f"[b]run[/b] {esc(state.run_id or '-')}  [b]{esc(state.status)}[/b]  "
                 f"{esc(state.visits_label())}",
                 f"[b]device[/b] {esc(state.device_id or '-')}  attested "
                 f"{receipt(state.attested)}{'  [$warning]SIM[/]' if state.sim else ''}",
                 f"[b]epoch[/b] {state.epoch}  [b]key[/b] {_key(state, current)}"]
        if current is not None and current.outcome == "running":
            lines.append(f"[b]now[/b] #{current.visit + 1} → {esc(fit(current.holder, context.get('name_w', 14)))} · "
                         f"{esc(state.current_phase or 'between phases')}")
        if context.get("replay"):  # a recording: only the view moves (no b, no c)
            lines.append(f"[$text-muted]{'end: live · p follow' if context.get('follow') else 'p play'}"
                         " · space one phase · [ ] visits[/]")
        elif state.paused_before:
            lines.append(f"[b $warning]paused before {esc(state.paused_before)}[/] ({esc(state.pause_reason or 'step')})"
                         + ("" if context.get("readonly") else " · space · p"))
        elif state.status in ("idle", "completed", "failed", "cancelled") and not context.get("readonly") \
                and not context.get("attached"):  # an attached run that ended has nothing left to run
            lines.append("[$text-muted]r run · space one phase · b break@HANDOFF[/]")
        bps = ", ".join(sorted(state.breakpoints)) or "none"
        lines.append(f"[b]breakpoints[/b] {esc(bps)}")
        lines.extend(_receipts_and_error(state, last, context.get("name_w", 14) - 2,
                                         narrow=bool(context.get("narrow"))))
        return "\n".join(lines)


def _receipts_and_error(state: RunState, last: Any, name_w: int = 12, *, narrow: bool = False) -> list[str]:
    """The last ended visit's receipts and the run's error, if any (a single run's panel and a fleet's)."""
    lines = []
    if last is not None:
        integrity, scrub = ("int", "scr") if narrow else ("integrity", "scrub")
        lines.append(f"[b]receipts[/b] #{last.visit + 1} {esc(fit(last.holder, name_w))}: {integrity} "
                     f"{receipt(last.integrity_ok)} {scrub} {receipt(last.scrub_verified)}")
    if state.error:
        token = "$warning" if state.status == "cancelled" else "$error"
        code = "" if state.error_code == state.status else f" ({esc(state.error_code or '?')})"
        lines.append(f"[b {token}]run {esc(state.status)}[/][{token}]{code}: {esc(state.error)}[/]")
    return lines


def _fleet_detail(state: RunState, context: dict[str, Any]) -> str:
    """A fleet: the run summed up, then one line per GPU (its device, where it is, its phase and epoch)."""
    devices = state.devices()
    lines = [f"[b]fleet[/b] {len(devices)}/{state.fleet_size or len(devices)} GPUs  [b]{esc(state.status)}[/b]  "
             f"{esc(state.visits_label())}"
             + ("  [$warning]SIM[/]" if state.sim else "")]
    narrow = bool(context.get("narrow")) or context.get("name_w", 14) < 28  # the long form wraps below 150
    for d in devices:
        lines.append(_device_line(d, narrow=narrow))
    if context.get("readonly") and not narrow:  # narrow: the status bar says READ-ONLY
        lines.append("[$text-muted]read-only: torchrun drives the fleet[/]")
    done = [v for v in state.visits.values() if v.ended]
    lines.extend(_receipts_and_error(state, done[-1] if done else None, context.get("name_w", 14) - 2,
                                     narrow=narrow))
    return "\n".join(lines)


def _device_line(d: DeviceView, *, narrow: bool = False) -> str:
    """``GPU1 ◆ bob · PROVISION ep 2  emu-gpu-1 ✓``; narrow (80 columns): ``GPU1 ◆ bob · PROVISION ep2 ✓``
    (the device id is on the GPU screen's card)."""
    where = "orchestrator" if d.at == "orchestrator" else d.at
    phase = f" · {esc(d.phase)}" if d.phase else ("" if d.status not in ("completed", "failed", "cancelled")
                                                     else f" · {esc(d.status)}")
    if narrow:
        where = "orch" if where == "orchestrator" else fit(where, 12)
        return f"[b]{esc(d.label)} ◆ {esc(where)}[/b]{phase} ep{d.epoch} {receipt(d.attested)}"
    return (f"[b]{esc(d.label)} ◆ {esc(fit(where, 20))}[/b]{phase} ep {d.epoch}  "
            f"[$text-muted]{esc(d.device_id or '-')}[/] {receipt(d.attested)}")


def _key(state: RunState, current: VisitView | None) -> str:
    """The provisioning key the GPU carries, named with its visit (a visit before its HANDOFF has none yet)."""
    if current is not None and current.outcome == "running" and current.key_fp is None:
        return f"[$text-muted]- (visit {current.visit + 1}'s comes at HANDOFF)[/]"
    if state.key_fp is None or state.key_visit is None:
        return "-"
    return f"{esc(state.key_fp[:16])} [$text-muted](visit {state.key_visit + 1})[/]"
