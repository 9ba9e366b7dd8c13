"""What every bridge between a run and the console offers: engine events in, Textual messages out.

:class:`Bridge` is the interface the app reads (what a bridge can do, never what it is) and the part every
bridge shares: the :class:`~gputravel.console.view.model.RunState` the screens render, folded from events, and
coalesced telemetry (a frame that arrives while the previous one has not been drawn replaces it). The bridges
are each one level below it, holding their parts: :class:`~gputravel.console.tui.live_bridge.LiveBridge` (a
session driving a real engine), :class:`~gputravel.console.tui.replay_bridge.ReplayBridge` (a recording played,
:class:`~gputravel.console.view.recorded_run.RecordedRun`), :class:`~gputravel.console.tui.fleet_view.FleetBridge`
(a fleet's recordings merged), :class:`~gputravel.console.tui.attach_bridge.AttachedBridge` (a run another
process drives, steered through its :class:`~gputravel.console.cli.control_client.ControlClient`) and
:class:`~gputravel.console.tui.launch_bridge.LaunchBridge` (the console's own headless runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.message import Message
from textual.notifications import SeverityLevel

from gputravel.console.run_telemetry import interval_tracker
from gputravel.console.view.model import RunState
from gputravel.console.view.receipts import fill_scrub_receipts
from gputravel.core import events as ev
from gputravel.core.phases import Phase
from gputravel.core.telemetry import History, TelemetryFrame

if TYPE_CHECKING:
    from textual.app import App

    from gputravel.console.tui.playback import Playback

__all__ = ["Bridge"]


class Bridge:
    """What every bridge offers the app: state, telemetry, and the operator's controls.

    The app asks a bridge what it can do, never what it is: ``live`` (it drives a run: :meth:`drive`, pause,
    breakpoints, cancel), ``replay`` (it plays a recording: its ``playback`` part seeks, jumps and plays),
    ``merges_gpus`` (a fleet's ranks merged), ``follow`` (a recording still being written). What a bridge cannot
    do is a no-op.
    """

    live = False
    replay = False
    attached = False  # a run another process drives, steered through its control channel (attach_bridge.py)
    launches = False  # starts its runs as headless `gputravel run` processes (launch_bridge.py)
    merges_gpus = False

    class StateChanged(Message):
        """New events were folded into ``bridge.state`` (``reset``: the state was rebuilt, e.g. a jump)."""

        def __init__(self, events: tuple[ev.Event, ...] = (), *, reset: bool = False) -> None:
            super().__init__()
            self.events = events
            self.reset = reset

    class TelemetryTicked(Message):
        """A telemetry frame is ready; take it with :meth:`Bridge.take_frame` (only the newest is kept)."""

    class Notice(Message):
        """Something the operator should read (an error from the engine, a refused control)."""

        def __init__(self, text: str, *, severity: SeverityLevel = "information") -> None:
            super().__init__()
            self.text = text
            self.severity = severity

    def __init__(self, app: App[Any]) -> None:
        self.app = app
        self.state = RunState()
        self.history = History()
        self.tracker = interval_tracker()
        self.latest_frame: TelemetryFrame | None = None
        self.last_devices: TelemetryFrame | None = None  # the newest frame that had devices (kept after a run)
        self._frame_pending = False
        #: a recording bridge's part that moves its view (None: a live run's bridge); the app seeks, jumps and
        #: plays through it
        self.playback: Playback | None = None

    # --- state ------------------------------------------------------------------------------------
    def fold(self, events: Iterable[ev.Event]) -> tuple[ev.Event, ...]:
        batch = tuple(events)
        for event in batch:
            self.state.apply(event)
            self.tracker(event)
        self.toast(batch)
        return batch

    def toast(self, batch: tuple[ev.Event, ...]) -> None:
        """Events that deserve a toast as well as a log line: a loss spike."""
        for e in batch:
            if isinstance(e, ev.LossSpiked):
                self.notice(f"loss spike: visit {e.visit + 1} {e.holder}, step {e.run_step}: {e.loss:.3f} > "
                            f"{e.factor:g} x running mean {e.mean:.3f}", "warning")

    def post_state(self, events: tuple[ev.Event, ...] = (), *, reset: bool = False) -> None:
        if reset or any(e.kind in ("VisitFailed", "RunFailed") for e in events):
            self.receipts_from_ledger()
        self.app.post_message(self.StateChanged(events, reset=reset))

    def receipts_from_ledger(self) -> None:
        """Failed and cancelled visits' scrub receipts from the run's ledger (no event carries them)."""
        fill_scrub_receipts(self.state, self.ledger_path)

    def notice(self, text: str, severity: SeverityLevel = "information") -> None:
        self.app.post_message(self.Notice(text, severity=severity))

    # --- telemetry (coalesced) ----------------------------------------------------------------
    def offer_frame(self, frame: TelemetryFrame) -> None:
        self.history.push(frame)
        self.latest_frame = frame
        if frame.devices:
            self.last_devices = frame
        if not self._frame_pending:
            self._frame_pending = True
            self.app.post_message(self.TelemetryTicked())

    def take_frame(self) -> TelemetryFrame | None:
        self._frame_pending = False
        return self.latest_frame

    # --- controls (overridden) --------------------------------------------------------------
    @property
    def badges(self) -> tuple[str, ...]:
        return ("SIM",) if self.state.sim else ()

    @property
    def running(self) -> bool:
        return False

    @property
    def in_control(self) -> bool:
        """Attached: this console steers the run (another may, then this one watches)."""
        return False

    @property
    def folder(self) -> Path | None:
        """Attached: the run's folder."""
        return None

    @property
    def watching(self) -> bool:
        """Attached to a run that another console steers: read-only until ``:take``."""
        return False

    @property
    def run_live(self) -> bool:
        """The run this bridge steers has not ended."""
        return self.running

    def take(self) -> None:
        """``:take``: steer the attached run (see attach_bridge.py)."""

    def shown_status(self) -> str | None:
        """The status the status bar shows when it is not the viewed state's own (None: the state's)."""
        return None

    def step(self) -> bool:
        """Run one phase; False when the app must start a run first."""
        raise NotImplementedError

    def toggle_pause(self) -> str:
        raise NotImplementedError

    def toggle_breakpoint(self, phase: Phase) -> bool:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Blocking clean-up at exit."""

    async def poll_telemetry(self, interval: float) -> None:
        """Sample telemetry every ``interval`` seconds (awaited inside the app's "telemetry-poll" worker); a
        bridge with nothing to sample returns at once."""

    @property
    def ledger_path(self) -> Path | None:
        return None

    # --- what the app asks of every bridge (a no-op where it has no meaning) --------------------------
    @property
    def polls_telemetry(self) -> bool:
        """Whether the app's "telemetry-poll" worker has anything to sample."""
        return self.live

    @property
    def torchrun_drives(self) -> bool:
        """A running fleet followed read-only: torchrun steers it, not the console's keys."""
        return self.merges_gpus and self.follow

    @property
    def paused(self) -> bool:
        return self.state.status == "paused"

    def preset_breakpoints(self, phases: Iterable[Phase]) -> None:
        """``--break-before``: shown before the run starts, applied when it is built (live runs only)."""

    def begin(self) -> None:
        """The app is mounted: start what the bridge does on its own (following a recording plays it)."""
        if self.playback is not None:
            self.playback.begin()

    def sync_control(self, *, post: bool = True) -> bool:
        """Take the engine's pause state into the view; False when nothing changed."""
        return False

    async def drive(self, *, stepping: bool = False) -> dict[str, Any] | None:
        """Run to the end (awaited inside the app's "visit" worker); None where there is no run to drive."""
        return None

    def resume(self) -> None:
        """Resume a paused run."""

    @property
    def follow(self) -> bool:
        """A recording still being written, followed (its playback's)."""
        return self.playback is not None and self.playback.follow

    def reset_view(self, state: RunState) -> None:
        """An empty view from ``state`` on (a recording's jump rebuilds it from the start)."""
        self.state = state
        self.history.clear()
        self.tracker = interval_tracker()
        self.latest_frame = self.last_devices = None
