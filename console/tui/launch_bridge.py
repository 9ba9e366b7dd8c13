"""The console's own runs (issue 35.1): ``r`` and ``space`` start a headless ``gputravel run`` process
(``console/cli/launch.py``) and attach to it as ``--attach`` does; the run outlives the console.

:class:`LaunchBridge` plays a recording as the attached bridge does, with no run until the operator starts one:
its parts are the :class:`~gputravel.console.cli.launch.Launcher` (this console's options), the run started last
(:class:`~gputravel.console.cli.launch.LaunchedRun`), its recording (followed from its first event, read every half
second) and one :class:`~gputravel.console.cli.control_client.ControlClient` (its channel; the breakpoints set
carry over to the next run). ``space`` starts the run with ``--start-paused`` and asks one step on
its channel (read from the start by a fresh run, so nothing asked before the run's engine exists is lost). A run
that ends before writing its final event (its input refused, the process killed) is shown FAILED with the end
of what it printed."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.control_client import ControlClient
from gputravel.console.cli.launch import LaunchedRun, Launcher
from gputravel.console.tui.attach_bridge import ATTACHED_SPEED
from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.playback import Playback
from gputravel.console.view.model import RunState
from gputravel.console.view.recorded_run import RecordedRun
from gputravel.core import events as ev
from gputravel.core.phases import Phase
from gputravel.core.recording import Recording
from gputravel.core.runfolder import RunFolder

__all__ = ["LaunchBridge"]

TERMINAL = ("completed", "failed", "cancelled", "partial")


class LaunchBridge(Bridge):
    """Starts runs as their own processes and steers the one started last through its run folder."""

    replay = True
    attached = True
    launches = True
    playback: Playback

    def __init__(self, app: App[Any], launcher: Launcher) -> None:
        super().__init__(app)
        self.launcher = launcher
        self.run: LaunchedRun | None = None
        self.control = ControlClient(None)
        self._ended_seen = False
        self.state = self.new_state()
        self.playback = Playback(self, self.recorded(RunFolder(Path("unstarted")).recording), follow=True,
                                 speed=ATTACHED_SPEED)

    def recorded(self, path: Path) -> RecordedRun:
        return RecordedRun(Recording(path, {}, ()), new_state=self.new_state)

    @property
    def end_state(self) -> RunState:
        """The run as its recording tells it (the view may be elsewhere)."""
        return self.playback.end_state

    @property
    def folder(self) -> Path | None:
        return self.control.folder

    @property
    def in_control(self) -> bool:
        return self.control.in_control

    @property
    def breaks(self) -> set[Phase]:
        return self.control.breaks

    def new_state(self) -> RunState:
        return RunState(breakpoints=set(self.breaks))

    # --- starting a run -----------------------------------------------------------------------
    def launch(self, *, stepping: bool) -> None:
        """A new headless run with this console's options and breakpoints; the view follows it from its start."""
        self.run = run = self.launcher.start(breakpoints=(str(p) for p in self.breaks), start_paused=stepping)
        self.control.follow_run(run.folder)
        self.playback.load(self.recorded(run.recording))
        self.reset_view(self.new_state())
        self.state.status = "starting"
        self._ended_seen = False
        self.control.take()
        if stepping:
            self.control.send("step")
        self._flush()
        self.post_state(reset=True)

    def _flush(self) -> None:
        """What was asked before the run made its folder, written once it has (the footer's controls with it)."""
        if self.control.queued and not self.control.waiting:
            self.control.flush()
            self._bindings_changed()

    def _bindings_changed(self) -> None:
        if self.app.is_running:  # the footer offers the controls only to the console in control
            self.app.refresh_bindings()

    def take(self) -> None:
        if self.folder is not None:
            self.control.take()
            self._bindings_changed()

    def close(self) -> None:
        """Leaving: control of the run started last is given up."""
        self.control.release()

    # --- following it ---------------------------------------------------------------------------
    def follow_more(self) -> bool:
        if self.run is None:
            return False
        self._flush()
        held = self.control.lost()
        if held is not None:
            self.notice(f"control taken by another console (pid {held.get('pid')}): this one watches read-only; "
                        ":take takes it back", "warning")
            self._bindings_changed()
        more = self.playback.recorded.read_more() or held is not None
        return self._check_exit() or more

    def _check_exit(self) -> bool:
        """The run's process ended without a final event in its recording: FAILED, with what it printed."""
        run = self.run
        if run is None or self._ended_seen or run.exit_code() is None:
            return False
        if self.end_state.status in TERMINAL or self.playback.recorded.meta_status in TERMINAL:
            self._ended_seen = True
            return False
        self.playback.recorded.read_more()  # what it wrote just before it ended
        self._ended_seen = True
        if self.end_state.status in TERMINAL:
            return True
        tail = run.output_tail().splitlines()
        said = next((line for line in reversed(tail) if line.startswith("error")), tail[-1] if tail else "")
        text = f"gputravel run exited {run.exit_code()} before its final event" + (f": {said}" if said else "")
        failed = ev.RunFailed(time.time(), self.state.run_id or "-", text, "internal")
        self.end_state.apply(failed)
        self.fold((failed,))
        self.notice(text, "error")
        self.post_state((failed,))
        return True

    # --- what the app asks ------------------------------------------------------------------------
    @property
    def run_live(self) -> bool:
        if self.run is None or (self._ended_seen and self.run.exit_code() is not None):
            return False
        return self.shown_status() not in TERMINAL

    @property
    def watching(self) -> bool:
        return self.folder is not None and not self.in_control

    @property
    def ledger_path(self) -> Path | None:
        return RunFolder(self.folder).ledger if self.folder is not None else None

    @property
    def running(self) -> bool:
        return self.playback.playing

    @property
    def paused(self) -> bool:
        """The run's pause (its recording's), not the view's."""
        return self.end_state.status == "paused"

    def shown_status(self) -> str | None:
        return None if self.run is None else self.playback.recorded.status(follow=True)

    @property
    def badges(self) -> tuple[str, ...]:
        """As the attached bridge's (ATTACHED, the position where the view left the live end); none but SIM
        before a run starts."""
        if self.run is None:
            return ("SIM",) if self.state.sim else ()
        shown = (*super().badges, self.playback.badge())
        return ("ATTACHED", *(b for b in shown if b != "FOLLOW ▶")) if self.in_control else shown

    def preset_breakpoints(self, phases: Iterable[Phase]) -> None:
        self.breaks.update(phases)
        self.state.breakpoints = {str(p) for p in self.breaks}

    def begin(self) -> None:
        """Nothing to follow until a run starts."""

    def steer(self, action: str, **kw: Any) -> None:
        """One request on the run's channel; the view goes with the run, to its live end."""
        self.control.send(action, **kw)
        self.playback.seek_end()

    def step(self) -> bool:
        if not self.run_live:
            self.launch(stepping=True)
        else:
            self.steer("step")
        return True

    def resume(self) -> None:
        if not self.run_live:
            self.launch(stepping=False)
        else:
            self.steer("resume")

    def toggle_pause(self) -> str:
        if not self.run_live:
            return "no run in progress: r runs, space steps"
        if self.end_state.status == "paused":
            self.steer("resume")
            return "resuming"
        self.steer("pause")
        return "pausing: after the current training step, else before the next phase"

    def toggle_breakpoint(self, phase: Phase) -> bool:
        if not self.run_live:  # the next run starts with it (--break-before)
            on = phase not in self.breaks
            (self.breaks.add if on else self.breaks.discard)(phase)
        else:
            on = self.control.toggle_break(phase)
        self.state.breakpoints = {str(p) for p in self.breaks}
        self.post_state()
        return on
