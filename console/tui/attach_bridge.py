"""``gputravel-console --attach RUN``: a run that another process drives (``gputravel run``), followed as
``--replay RUN --follow`` does and steered through the run's control channel (``console/cli/run_control.py``).

The run folder is the only link: what the run does comes from its recording (read every half second), what the
operator asks goes into its ``control.jsonl``, and the run applies it as the console's keys do in-process
(pause after the current training step, cancel at the next chunk in PROVISION, breakpoints and steps between
phases). Leaving the console (``q``) leaves the run going."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.run_control import send_control
from gputravel.console.tui.replay_bridge import ReplayBridge
from gputravel.console.view.model import RunState
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording

__all__ = ["ATTACHED_SPEED", "AttachedBridge"]

#: How fast the view plays what the run appended: at once (a follow replays at 8x, seconds behind the run; a
#: console that steers shows where the run is now, so a control is judged by the run's state, not a lag)
ATTACHED_SPEED = 1000.0


class AttachedBridge(ReplayBridge):
    """The follow view of a run, with its controls: each key a request on the run's channel."""

    attached = True

    def __init__(self, app: App[Any], recording: Recording, folder: Path) -> None:
        self.breaks: set[Phase] = set()  # the breakpoints this console set (the view's state is rebuilt)
        super().__init__(app, recording, follow=True, speed=ATTACHED_SPEED)
        self.folder = folder
        self.sent: list[dict[str, Any]] = []  # what this console asked, in order (the channel holds it too)

    def _send(self, action: str, **kw: Any) -> None:
        self.sent.append(send_control(self.folder, action, sender="gputravel-console --attach", **kw))

    @property
    def badges(self) -> tuple[str, ...]:
        return ("ATTACHED", *super().badges)

    @property
    def paused(self) -> bool:
        """The run's pause (its recording's), not the view's."""
        return self.end_state.status == "paused"

    def new_state(self) -> RunState:
        return RunState(breakpoints=set(self.breaks))

    def _live_end(self) -> None:
        self.seek_end()  # the view goes with the run, to its live end

    def step(self) -> bool:
        self._send("step")
        self._live_end()
        return True

    def toggle_pause(self) -> str:
        if self.end_state.status == "paused":
            self._send("resume")
            self._live_end()
            return "resuming"
        self._send("pause")
        self._live_end()
        return "pausing: after the current training step, else before the next phase"

    def resume(self) -> None:
        self._send("resume")
        self._live_end()

    def toggle_breakpoint(self, phase: Phase) -> bool:
        on = phase not in self.breaks
        (self.breaks.add if on else self.breaks.discard)(phase)
        self.state.breakpoints = set(self.breaks)
        self._send("break", phase=str(phase), on=on)
        self.post_state()
        return on

    def cancel(self) -> None:
        self._send("cancel")
        self._live_end()

    @property
    def run_live(self) -> bool:
        """The run has not ended (as its recording says)."""
        return self.shown_status() not in ("completed", "failed", "cancelled", "partial")
