"""``gputravel-console --attach RUN``: a run that another process drives (``gputravel run``), followed as
``--replay RUN --follow`` does and steered through the run's control channel (``console/cli/run_control.py``).

The run folder is the only link: what the run does comes from its recording (read every half second), what the
operator asks goes into its ``control.jsonl``, and the run applies it as the console's keys do in-process
(pause after the current training step, cancel at the next chunk in PROVISION, breakpoints and steps between
phases). Leaving the console (``q``) asks: detach (the run goes on), cancel the run, or stay.

One console steers a run at a time: the first to attach takes control (a ``take`` line on the channel); one that
attaches while another holds it watches read-only until ``:take``, which the other sees at its next read (within
half a second) and turns read-only in turn."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.run_control import controller, send_control
from gputravel.console.tui.replay_bridge import ReplayBridge
from gputravel.console.view.model import RunState
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording
from gputravel.core.runfolder import RunFolder

__all__ = ["ATTACHED_SPEED", "AttachedBridge"]

#: How fast the view plays what the run appended: at once (a follow replays at 8x, seconds behind the run; a
#: console that steers shows where the run is now, so a control is judged by the run's state, not a lag)
ATTACHED_SPEED = 1000.0


class AttachedBridge(ReplayBridge):
    """The follow view of a run, with its controls: each key a request on the run's channel."""

    attached = True

    def __init__(self, app: App[Any], recording: Recording, folder: Path | None, *, take: bool = True) -> None:
        self.breaks: set[Phase] = set()  # the breakpoints this console set (the view's state is rebuilt)
        super().__init__(app, recording, follow=True, speed=ATTACHED_SPEED)
        self.folder = folder
        self.sent: list[dict[str, Any]] = []  # what this console asked, in order (the channel holds it too)
        self.console_id = uuid.uuid4().hex[:12]
        #: whether this console steers the run (else it watches, read-only, until :take)
        self.in_control = False
        #: the console that holds control, where another does (its take line)
        self.holder: dict[str, Any] | None = None
        if folder is not None and take:
            self.claim()

    def claim(self) -> None:
        """Attaching: take control unless another live console holds it (then watch until :take)."""
        assert self.folder is not None
        held = controller(self.folder)
        if held is None or held.get("console") == self.console_id:
            self.take()
        else:
            self.holder = held

    def take(self) -> None:
        """``:take``: this console steers the run from now on; the one that did sees it at its next read."""
        assert self.folder is not None
        self.sent.append(send_control(self.folder, "take", sender="gputravel-console --attach",
                                      console=self.console_id))
        self.in_control, self.holder = True, None
        self._bindings_changed()

    def check_control(self) -> bool:
        """Whether another console took control since (then this one watches, read-only); True on a change."""
        if self.folder is None or not self.in_control:
            return False
        held = controller(self.folder)
        if held is None or held.get("console") == self.console_id:
            return False
        self.in_control, self.holder = False, held
        self.notice(f"control taken by another console (pid {held.get('pid')}): this one watches read-only; "
                    ":take takes it back", "warning")
        self._bindings_changed()
        return True

    def close(self) -> None:
        """Leaving: control is given up (a console attaching next takes it)."""
        if self.folder is not None and self.in_control and self.folder.is_dir():
            send_control(self.folder, "release", sender="gputravel-console --attach", console=self.console_id)
            self.in_control = False
        super().close()

    def _bindings_changed(self) -> None:
        if self.app.is_running:  # the footer offers the controls only to the console in control
            self.app.refresh_bindings()

    def follow_more(self) -> bool:
        changed = self.check_control()
        return super().follow_more() or changed

    def _send(self, action: str, **kw: Any) -> None:
        if self.folder is None or not self.in_control:
            return
        self.sent.append(send_control(self.folder, action, sender="gputravel-console --attach",
                                      console=self.console_id, **kw))

    @property
    def watching(self) -> bool:
        return self.folder is not None and not self.in_control

    @property
    def ledger_path(self) -> Path | None:
        return RunFolder(self.folder).ledger if self.folder is not None else super().ledger_path

    @property
    def badges(self) -> tuple[str, ...]:
        """ATTACHED for the console that steers; the view's position only where it left the live end (a steered
        run is shown where it is: ``FOLLOW ▶`` said nothing there and cost the status bar its room)."""
        shown = super().badges
        if not self.in_control:
            return shown
        return ("ATTACHED", *(b for b in shown if b != "FOLLOW ▶"))

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
