"""The console's own runs (issue 35.1): ``r`` and ``space`` start a headless ``gputravel run`` process
(``console/cli/launch.py``) and attach to it as ``--attach`` does; the run outlives the console.

:class:`LaunchBridge` is an :class:`~gputravel.console.tui.attach_bridge.AttachedBridge` that has no run until
the operator starts one: its recording is the started run's (followed from its first event, read every half
second), its controls the run's channel. ``space`` starts the run with ``--start-paused`` and asks one step on
its channel (read from the start by a fresh run, so nothing asked before the run's engine exists is lost). A run
that ends before writing its final event (its input refused, the process killed) is shown FAILED with the end
of what it printed."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual.app import App

from gputravel.console.cli.launch import LaunchedRun, Launcher
from gputravel.console.tui.attach_bridge import AttachedBridge
from gputravel.core import events as ev
from gputravel.core.phases import Phase
from gputravel.core.recording import Player, Recording
from gputravel.core.runfolder import RunFolder

__all__ = ["LaunchBridge"]

TERMINAL = ("completed", "failed", "cancelled", "partial")


class LaunchBridge(AttachedBridge):
    """Starts runs as their own processes and steers the one started last through its run folder."""

    launches = True

    def __init__(self, app: App[Any], launcher: Launcher) -> None:
        self.launcher = launcher
        self.run: LaunchedRun | None = None
        self.queued: list[tuple[str, dict[str, Any]]] = []  # asked before the run's folder exists
        self._ended_seen = False
        super().__init__(app, Recording(RunFolder(Path("unstarted")).recording, {}, ()), None, take=False)

    # --- starting a run -----------------------------------------------------------------------
    def launch(self, *, stepping: bool) -> None:
        """A new headless run with this console's options and breakpoints; the view follows it from its start."""
        self.run = run = self.launcher.start(breakpoints=(str(p) for p in self.breaks), start_paused=stepping)
        self.folder = run.folder
        self.player = Player(Recording(run.recording, {}, ()))
        self.state, self.end_state, self.meta_status = self.new_state(), self.new_state(), None
        self.state.status = "starting"
        self.history.clear()
        self.latest_frame = self.last_devices = None
        self.queued.clear()
        self._ended_seen = False
        self.in_control, self.holder = True, None
        self._queue("take")
        if stepping:
            self._queue("step")
        self._flush()
        self.playing = True
        self.post_state(reset=True)

    def _queue(self, action: str, **kw: Any) -> None:
        self.queued.append((action, kw))

    def _flush(self) -> None:
        """Write what was asked once the run has made its folder (it is the run's to create)."""
        if self.folder is None or not self.folder.is_dir():
            return
        while self.queued:
            action, kw = self.queued.pop(0)
            if action == "take":
                super().take()
            else:
                super()._send(action, **kw)

    def _send(self, action: str, **kw: Any) -> None:
        if self.folder is not None and not self.folder.is_dir():
            self._queue(action, **kw)
            return
        self._flush()
        super()._send(action, **kw)

    def take(self) -> None:
        if self.folder is not None:
            super().take()

    # --- following it ---------------------------------------------------------------------------
    def follow_more(self) -> bool:
        if self.run is None:
            return False
        self._flush()
        more = super().follow_more()
        return self._check_exit() or more

    def _check_exit(self) -> bool:
        """The run's process ended without a final event in its recording: FAILED, with what it printed."""
        run = self.run
        if run is None or self._ended_seen or run.exit_code() is None:
            return False
        if self.end_state.status in TERMINAL or self.meta_status in TERMINAL:
            self._ended_seen = True
            return False
        super().follow_more()  # what it wrote just before it ended
        if self.end_state.status in TERMINAL:
            self._ended_seen = True
            return True
        self._ended_seen = True
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
        return super().run_live

    def shown_status(self) -> str | None:
        return None if self.run is None else super().shown_status()

    @property
    def badges(self) -> tuple[str, ...]:
        if self.run is None:
            return ("SIM",) if self.state.sim else ()
        return super().badges

    def preset_breakpoints(self, phases: Iterable[Phase]) -> None:
        self.breaks.update(phases)
        self.state.breakpoints = {str(p) for p in self.breaks}

    def begin(self) -> None:
        """Nothing to follow until a run starts."""

    def step(self) -> bool:
        if not self.run_live:
            self.launch(stepping=True)
            return True
        return super().step()

    def resume(self) -> None:
        if not self.run_live:
            self.launch(stepping=False)
            return
        super().resume()

    def toggle_pause(self) -> str:
        if not self.run_live:
            return "no run in progress: r runs, space steps"
        return super().toggle_pause()

    def toggle_breakpoint(self, phase: Phase) -> bool:
        if not self.run_live:  # the next run starts with it (--break-before)
            on = phase not in self.breaks
            (self.breaks.add if on else self.breaks.discard)(phase)
            self.state.breakpoints = {str(p) for p in self.breaks}
            self.post_state()
            return on
        return super().toggle_breakpoint(phase)
