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

from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.control_client import ControlClient
from gputravel.console.cli.run_control import run_breakpoints
from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.playback import Playback
from gputravel.console.view.model import RunState
from gputravel.console.view.recorded_run import RecordedRun
from gputravel.console.view.run_info import read_run, status_word
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording
from gputravel.core.runfolder import FINAL_STATUSES, RunFolder, driving_process, pid_alive, read_status

__all__ = ["ATTACHED_SPEED", "AttachedBridge"]

#: How fast the view plays what the run appended: at once (a follow replays at 8x, seconds behind the run; a
#: console that steers shows where the run is now, so a control is judged by the run's state, not a lag)
ATTACHED_SPEED = 1000.0


class AttachedBridge(Bridge):
    """The follow view of a run, with its controls: each key a request on the run's channel. Its parts: the
    :class:`~gputravel.console.tui.playback.Playback` of the run's recording and the
    :class:`~gputravel.console.cli.control_client.ControlClient` (who steers, what was asked)."""

    replay = True
    attached = True
    playback: Playback

    def __init__(self, app: App[Any], recording: Recording, folder: Path | None, *, take: bool = True) -> None:
        super().__init__(app)
        # the run's own breakpoints (its --break-before, and those asked on its channel), not none
        self.control = ControlClient(folder, breaks={Phase(name) for name in run_breakpoints(folder)}
                                     if folder is not None and folder.is_dir() else None)
        self.state = self.new_state()
        self.playback = Playback(self, RecordedRun(recording, new_state=self.new_state), follow=True,
                                 speed=ATTACHED_SPEED)
        if folder is not None and take:
            self.control.claim()
            self._bindings_changed()

    @property
    def folder(self) -> Path | None:
        return self.control.folder

    @property
    def in_control(self) -> bool:
        return self.control.in_control

    @property
    def breaks(self) -> set[Phase]:
        return self.control.breaks

    def take(self) -> None:
        """``:take``: this console steers the run from now on; the one that did sees it at its next read."""
        self.control.take()
        self._bindings_changed()

    def check_control(self) -> bool:
        """Whether another console took control since (then this one watches, read-only); True on a change."""
        held = self.control.lost()
        if held is None:
            return False
        self.notice(f"control taken by another console (pid {held.get('pid')}): this one watches read-only; "
                    ":take takes it back", "warning")
        self._bindings_changed()
        return True

    def close(self) -> None:
        """Leaving: control is given up (a console attaching next takes it)."""
        self.control.release()

    def _bindings_changed(self) -> None:
        if self.app.is_running:  # the footer offers the controls only to the console in control
            self.app.refresh_bindings()

    def follow_more(self) -> bool:
        changed = self.check_control()
        recorded = self.playback.recorded
        more = recorded.read_more()
        if self.folder is not None and (more or recorded.folder_status is None):
            recorded.folder_status = self._folder_status(self.folder)
        return more or changed

    def _folder_status(self, folder: Path) -> str | None:
        """How the folder says the run ended where the recording has no final event (None: it has one, or the
        run goes on): ``status.json``'s final status (a full disk refused the recording's ``RunFailed``; it read
        RUNNING, operator walk session 16), else, once the process that wrote the recording (its meta's ``pid``)
        is gone, what ``gputravel runs`` says (``died``, ``unknown``)."""
        if self.end_state.status in ("completed", "failed", "cancelled"):
            return None
        written = read_status(folder)
        if written.get("status") in FINAL_STATUSES:
            code = written.get("code")
            return status_word(str(written["status"]), code if isinstance(code, str) else None)
        if driving_process(folder) is not None:
            return None
        pid = self.playback.player.recording.meta.get("pid")  # the process that wrote the recording
        if not isinstance(pid, int) or pid_alive(pid):
            return None  # no process to ask about (a recording written by something else), or it lives: it runs
        info = read_run(folder)
        return info.word if info.status not in ("running", "paused", "not started") else None

    @property
    def end_state(self) -> RunState:
        """The run as its recording tells it (the view may be elsewhere)."""
        return self.playback.end_state

    def shown_status(self) -> str | None:
        return self.playback.recorded.status(follow=True)

    @property
    def running(self) -> bool:
        return self.playback.playing

    @property
    def watching(self) -> bool:
        return self.folder is not None and not self.in_control

    @property
    def ledger_path(self) -> Path | None:
        if self.folder is not None:
            return RunFolder(self.folder).ledger
        path = self.playback.player.recording.meta.get("ledger")
        return Path(path) if path else None

    @property
    def badges(self) -> tuple[str, ...]:
        """ATTACHED for the console that steers; the view's position only where it left the live end (a steered
        run is shown where it is: ``FOLLOW ▶`` said nothing there and cost the status bar its room)."""
        shown = (*super().badges, self.playback.badge())
        if not self.in_control:
            return shown
        return ("ATTACHED", *(b for b in shown if b != "FOLLOW ▶"))

    @property
    def paused(self) -> bool:
        """The run's pause (its recording's), not the view's."""
        return self.end_state.status == "paused"

    def new_state(self) -> RunState:
        return RunState(breakpoints=set(self.breaks))

    def ended(self) -> str | None:
        """What a control key answers once the run has ended (None while it runs): nothing is written to the
        channel of a run that reads it no more, and a run that did not complete says how to continue it."""
        if self.run_live:
            return None
        status = self.shown_status()
        text = f"the run has ended ({status}): there is nothing to steer"
        if status != "completed" and self.folder is not None:
            text += f"; gputravel run --resume --out {self.folder} continues it"
        return text

    def steer(self, action: str, **kw: Any) -> None:
        """One request on the run's channel; the view goes with the run, to its live end. A run that has ended
        gets none: the operator is told so (``ended``)."""
        ended = self.ended()
        if ended is not None:
            self.notice(ended, "warning")
            return
        self.control.send(action, **kw)
        self.playback.seek_end()

    def step(self) -> bool:
        self.steer("step")
        return True

    def toggle_pause(self) -> str:
        ended = self.ended()
        if ended is not None:  # the app shows the answer
            return ended
        if self.end_state.status == "paused":
            self.steer("resume")
            return "resuming"
        self.steer("pause")
        return "pausing: after the current training step, else before the next phase"

    def resume(self) -> None:
        self.steer("resume")

    def toggle_breakpoint(self, phase: Phase) -> bool:
        on = self.control.toggle_break(phase)
        self.state.breakpoints = set(self.breaks)
        self.post_state()
        return on

    def cancel(self) -> None:
        self.steer("cancel")

    @property
    def run_live(self) -> bool:
        """The run has not ended (as its recording says)."""
        status = self.shown_status() or ""
        return status.split(":")[0] not in ("completed", "failed", "cancelled", "partial", "died", "unknown")
