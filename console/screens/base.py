"""What every console screen shares: the status bar, its body, the operations log, the ``:`` line, the footer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer

from gputravel.console.view_model import RunState
from gputravel.console.widgets.command_line import CommandLine
from gputravel.console.widgets.ops_log import OpsLog
from gputravel.console.widgets.status_bar import StatusBar, StatusSummary


def summarise(state: RunState, screen: str, badges: tuple[str, ...]) -> StatusSummary:
    visit = ""
    if state.current_visit is not None:
        visit = f"visit {state.current_visit + 1}/{state.visits_planned or '?'} {state.current_holder or ''}".rstrip()
    phase = state.current_phase
    status = state.status
    if state.paused_before:
        status, phase = f"paused before {state.paused_before}", None
    return StatusSummary(screen=screen, status=status, run_id=state.run_id, where=state.gpu_at, phase=phase,
                         epoch=state.epoch, visit=visit, badges=badges)


class ConsoleScreen(Screen[None]):
    """A screen of the console. Subclasses compose their body and render a :class:`RunState` in ``show_state``."""

    SCREEN_NAME: ClassVar[str] = "screen"
    HELP: ClassVar[str] = ""
    AUTO_FOCUS = None  # keys reach the app's bindings until the operator focuses something

    class Shown(Message):
        """The screen became the current one and wants the latest state."""

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status-bar")
        with Vertical(id="screen-body"):
            yield from self.compose_body()
        yield OpsLog(id="ops-log")
        yield CommandLine(id="command-line")
        yield Footer()

    def compose_body(self) -> Iterable[Widget]:
        return ()

    def on_screen_resume(self) -> None:
        self.post_message(self.Shown())

    def show(self, state: RunState, *, badges: tuple[str, ...] = (), context: dict[str, Any] | None = None) -> None:
        """Attributes down: the app hands every screen the state to draw. An update that arrives while the
        screen is composing or tearing down (its widgets not there) is skipped: the screen asks for the
        state again when it is shown (``Shown``)."""
        try:
            self.query_one(StatusBar).summary = summarise(state, self.SCREEN_NAME, badges)
            self.query_one(OpsLog).lines = tuple(state.oplog)[-40:]
            self.show_state(state, context or {})
        except NoMatches:
            pass

    def show_state(self, state: RunState, context: dict[str, Any]) -> None:
        """Draw ``state`` (the run as events tell it)."""

    def open_command_line(self) -> None:
        self.query_one(CommandLine).open()
