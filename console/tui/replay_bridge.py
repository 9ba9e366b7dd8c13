"""The bridge that plays a recording (``gputravel-console --replay``), with the live bridge's controls moving the
view only. Its recording is a part it holds, :class:`~gputravel.console.view.recorded_run.RecordedRun` (the
cursor, the run's own state, reading what a followed run appended); the fleet, attached and launched bridges are
the one level below it that play a recording too, each with its own parts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.playback import Playback
from gputravel.console.view.model import RunState
from gputravel.console.view.recorded_run import RecordedRun
from gputravel.core.errors import GpuTravelError
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["ReplayBridge"]


class ReplayBridge(Bridge):
    """Plays a recording: step one phase, play / pause, jump to a visit or to either end.

    Every control here moves the view only (a recording has no run to steer), so all of them work in
    ``--readonly`` too. Following a recording still being written, ``end`` (and ``]`` past the last visit, and
    ``p`` / ``space`` that reach the end) go back to the live end and keep following (its ``playback``); the
    run's status (:meth:`shown_status`) is the recording's newest, never the paused view's."""

    replay = True
    playback: Playback

    def __init__(self, app: App[Any], recording: Recording, *, speed: float = 8.0, follow: bool = False) -> None:
        super().__init__(app)
        self.state = self.new_state()
        self.playback = Playback(self, RecordedRun(recording, new_state=self.new_state), speed=speed, follow=follow)

    def new_state(self) -> RunState:
        return RunState(breakpoints=set())

    @property
    def ledger_path(self) -> Path | None:
        path = self.playback.player.recording.meta.get("ledger")
        return Path(path) if path else None

    @property
    def running(self) -> bool:
        return self.playback.playing

    @property
    def paused(self) -> bool:
        return self.state.status == "paused" or not self.playback.playing

    @property
    def badges(self) -> tuple[str, ...]:
        return (*super().badges, self.playback.badge())

    def shown_status(self) -> str | None:
        """The run's status as its recording's newest run event (else its meta) says: never the paused view's."""
        return self.playback.recorded.status(follow=self.playback.follow)

    def step(self) -> bool:
        self.playback.step()
        return True

    def toggle_pause(self) -> str:
        return self.playback.toggle()

    def toggle_breakpoint(self, phase: Phase) -> bool:
        raise GpuTravelError("breakpoints belong to a live run")

    def cancel(self) -> None:
        self.playback.stop()

    def follow_more(self) -> bool:
        """Read what the run appended since (following); True when there was something."""
        return self.playback.recorded.read_more()
