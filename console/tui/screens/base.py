"""What every console screen shares: the status bar, its body, the operations log, the ``:`` line, the footer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget

from gputravel.console.tui.widgets.command_line import CommandLine
from gputravel.console.tui.widgets.footer import ConsoleFooter
from gputravel.console.tui.widgets.ops_log import OpsLog
from gputravel.console.tui.widgets.status_bar import StatusBar, StatusSummary
from gputravel.console.tui.widgets.table_filter import TableFilter
from gputravel.console.tui.widgets.text import fit
from gputravel.console.view.model import RunState
from gputravel.console.view.training import pending_label


def summarise(state: RunState, screen: str, badges: tuple[str, ...], status: str | None = None) -> StatusSummary:
    """The status bar's line; ``status``: the run's, where it is not the viewed state's (a recording's final
    event while the view is elsewhere, CANCELLING... until the engine confirms)."""
    if state.fleet:  # every GPU where it is (0→alice 1→orch), the fleet's visits ended of planned
        where = " ".join(f"{d.gpu}→{'orch' if d.at == 'orchestrator' else d.at}" for d in state.devices())
        return StatusSummary(screen=screen, status=status or state.status, run_id=None, where=where or "-",  # a run id per GPU
                             epoch=state.epoch, visit=f"visits {state.visits_ended()}/{state.visits_planned or '?'}",
                             badges=badges, fleet=True)
    visit = ""
    if state.current_visit is not None:
        holder = fit(state.current_holder or "", 28)  # the status bar drops what does not fit, by width
        visit = f"visit {state.current_visit + 1}/{state.visits_planned or '?'} {holder}".rstrip()
    phase = state.current_phase
    shown = status or state.status
    if state.paused_before and not status:
        shown, phase = f"paused before {state.paused_before}", None
    if state.current_phase == "TRAIN" and state.train_progress:  # steps arrive while TRAIN runs
        train = "TRAIN {}/{}".format(*state.train_progress)
        if state.paused_before and not status:
            shown, phase = f"paused in {train}", None
        else:
            phase = train
    if not status and not state.ended:  # CANCELLING... / PAUSING... from the recording's ControlRequested
        shown = pending_label(state.pending) or shown
    return StatusSummary(screen=screen, status=shown, run_id=state.run_id, where=state.gpu_at, phase=phase,
                         epoch=state.epoch, visit=visit, badges=badges)


def hint_for(context: dict[str, Any]) -> str:
    """The keys the empty log suggests: only those that work here."""
    if context.get("follow"):
        return "the run has not written any yet (p pauses the view, end follows again)"
    if context.get("replay"):
        return "[b]p[/b] plays, [b]space[/b] steps one phase"
    if context.get("readonly"):
        return "read-only: the run is steered elsewhere"
    return "[b]r[/b] runs, [b]space[/b] steps one phase"


class ConsoleScreen(Screen[None]):
    """A screen of the console. Subclasses compose their body and render a :class:`RunState` in ``show_state``."""

    SCREEN_NAME: ClassVar[str] = "screen"
    HELP: ClassVar[str] = ""
    FLEET_HELP: ClassVar[str] = ""  # added to HELP when the console shows a fleet
    AUTO_FOCUS: ClassVar[str | None] = None  # keys reach the app's bindings until the operator focuses something
    BINDINGS = [Binding("slash", "filter", "Filter", show=False),
                Binding("escape", "clear_filter", "Clear filter", show=False)]
    #: The text the screen's ``/`` filter keeps rows by ("" keeps all).
    needle: str = ""

    class Shown(Message):
        """The screen became the current one and wants the latest state."""

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status-bar")
        with Vertical(id="screen-body"):
            yield from self.compose_body()
        yield OpsLog(id="ops-log")
        from gputravel.console.tui.bench_args import BENCH_ARGS

        command_line = CommandLine(id="command-line")
        command_line.extra_words["bench"] = tuple(BENCH_ARGS)  # Tab completes `:bench pr` -> `:bench provision`
        yield command_line
        yield ConsoleFooter()

    def compose_body(self) -> Iterable[Widget]:
        return ()

    def on_screen_resume(self) -> None:
        self.post_message(self.Shown())

    def on_resize(self) -> None:
        self.post_message(self.Shown())  # layouts that depend on the width (e.g. the holders table) redraw

    def show(self, state: RunState, *, badges: tuple[str, ...] = (), context: dict[str, Any] | None = None,
             status: str | None = None) -> None:
        """Attributes down: the app hands every screen the state to draw. An update that arrives while the
        screen is composing or tearing down (its widgets not there) is skipped: the screen asks for the
        state again when it is shown (``Shown``)."""
        try:
            self.query_one(StatusBar).summary = summarise(state, self.SCREEN_NAME, badges, status)
            log = self.query_one(OpsLog)
            log.hint = hint_for(context or {})
            log.lines = tuple(state.oplog)[-40:]
            self.show_state(state, context or {})
        except NoMatches:
            pass

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        """Draw ``state`` (the run as events tell it)."""

    def open_command_line(self) -> None:
        self.query_one(CommandLine).open()

    # --- the / filter (screens with a table compose a TableFilter) --------------------------
    def action_filter(self) -> None:
        found = self.query(TableFilter)
        if not found:
            self.notify(f"the {self.SCREEN_NAME} screen has no table to filter", timeout=2)
            return
        found.first().open()

    def action_clear_filter(self) -> None:
        for table_filter in self.query(TableFilter):
            if table_filter.needle:
                table_filter.action_clear()

    @on(TableFilter.FilterChanged)
    def _filter_changed(self, event: TableFilter.FilterChanged) -> None:
        event.stop()
        self.needle = event.needle
        self.post_message(self.Shown())  # redraw with the filter applied
