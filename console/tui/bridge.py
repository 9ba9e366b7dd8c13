"""The one bridge between a run and the console: engine events in, Textual messages out.

:class:`LiveBridge` drives a real engine (through :class:`~gputravel.core.session.Session`) and samples
telemetry; :class:`~gputravel.console.tui.replay_bridge.ReplayBridge` plays a recording with the same controls. Both fold events into one
:class:`~gputravel.console.view.model.RunState` that the screens render, and both coalesce telemetry: a frame
that arrives while the previous one has not been drawn replaces it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.message import Message

from gputravel.console.cli.run_end import RunEnding, ending_code
from gputravel.console.run_telemetry import interval_tracker
from gputravel.console.view.model import TERMINAL_STATUSES, RunState
from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError
from gputravel.core.ledger import read_rows
from gputravel.core.phases import Phase
from gputravel.core.recording import Recorder
from gputravel.core.runfolder import RunFolder
from gputravel.core.session import Session
from gputravel.core.telemetry import EmulatedSource, History, Sampler, TelemetryFrame
from gputravel.core.travel.holders import HolderState

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["Bridge", "LiveBridge"]


class Bridge:
    """What every bridge offers the app: state, telemetry, and the operator's controls.

    The app asks a bridge what it can do, never what it is: ``live`` (it drives a run: :meth:`drive`, pause,
    breakpoints, cancel), ``replay`` (it plays a recording: :meth:`play`, seek, jump), ``merges_gpus`` (a
    fleet's ranks merged), ``follow`` (a recording still being written). What a bridge cannot do is a no-op.
    """

    live = False
    replay = False
    attached = False  # a run another process drives, steered through its control channel (attach_bridge.py)
    launches = False  # starts its runs as headless `gputravel run` processes (launch_bridge.py)
    in_control = False  # attached: this console steers the run (another may, then this one watches)
    folder: Path | None = None  # attached: the run's folder
    merges_gpus = False
    follow = False
    playing = False

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

        def __init__(self, text: str, *, severity: str = "information") -> None:
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
        """A failed or cancelled visit's scrub receipt as its ledger row has it (``visit-failed``,
        ``visit-cancelled``: the abort scrubs the buffer and says whether it read back as zero; no event
        carries that). The k-th failed attempt of a visit is the k-th such row of that visit."""
        path = self.ledger_path
        open_rows = [v for v in self.state.visits.values() if v.outcome in ("failed", "cancelled")
                     and v.scrub_verified is None]
        if path is None or not open_rows or self.state.fleet or not Path(path).is_file():
            return
        try:
            rows = [r for r in read_rows(Path(path)) if r.kind in ("visit-failed", "visit-cancelled")]
        except GpuTravelError:
            return
        by_visit: dict[int, list[Any]] = {}
        for r in rows:
            if isinstance(r.detail.get("visit"), int):
                by_visit.setdefault(r.detail["visit"], []).append(r)
        for visit in open_rows:
            ended = [v for v in self.state.visits.values() if v.visit == visit.visit
                     and v.outcome in ("failed", "cancelled")]
            found = by_visit.get(visit.visit, [])
            k = ended.index(visit)
            if k < len(found) and isinstance(found[k].detail.get("scrub_verified"), bool):
                visit.scrub_verified = found[k].detail["scrub_verified"]

    def notice(self, text: str, severity: str = "information") -> None:
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

    def sync_control(self, *, post: bool = True) -> bool:
        """Take the engine's pause state into the view; False when nothing changed."""
        return False

    async def drive(self, *, stepping: bool = False) -> dict[str, Any] | None:
        """Run to the end (awaited inside the app's "visit" worker); None where there is no run to drive."""
        return None

    async def play(self) -> None:
        """Play the recording (awaited inside the app's "replay" worker); returns at once with none."""

    def resume(self) -> None:
        """Resume a paused run."""

    def restart(self) -> None:
        """Play from the start."""

    def seek(self, position: int) -> None:
        """Show the recording as it stood after ``position`` items."""

    def seek_end(self) -> None:
        """Show the recording's end (following: the live end, followed again)."""

    def jump_visit(self, visit: int) -> None:
        """Show the start of visit ``visit`` (0-based)."""

    def current_visit(self) -> int:
        """The visit the view is in (-1: none yet)."""
        return -1

    def at_visit_start(self, visit: int) -> bool:
        return False


class LiveBridge(Bridge):
    """A live run: builds the engine off the loop, pumps its events, samples telemetry."""

    live = True

    def __init__(self, app: App[Any], *, engine_factory: Callable[[], Any], sampler: Sampler | None = None,
                 record: Path | bool = True) -> None:
        super().__init__(app)
        self.engine_factory = engine_factory
        self.session = Session(engine_factory)
        self.sampler = sampler if sampler is not None else Sampler()
        if self.sampler.emulated is None:
            self.sampler.emulated = EmulatedSource()
        self.record = record
        self.recorder: Recorder | None = None
        self.report: dict[str, Any] | None = None
        self._in_flight = False
        #: "cancelling" / "pausing": asked for, not yet confirmed by the engine (the status bar says so)
        self.pending: str | None = None

    @property
    def running(self) -> bool:
        return self._in_flight

    def preset_breakpoints(self, phases: Iterable[Phase]) -> None:
        for phase in phases:
            self.toggle_breakpoint(phase, post=False)

    def shown_status(self) -> str | None:
        """CANCELLING... / PAUSING... from the request until the engine confirms it (a final event, a pause)."""
        if self.pending == "cancelling" and (self.state.ended or not self._in_flight):
            self.pending = None
        elif self.pending == "pausing" and (self.state.paused_before or self.state.ended or not self._in_flight):
            self.pending = None
        return f"{self.pending}..." if self.pending else None

    @property
    def ledger_path(self) -> Path | None:
        out = self.session.out_dir
        return RunFolder(out).ledger if out is not None else None

    # --- the run (awaited inside the app's "visit" worker) ------------------------------------
    async def drive(self, *, stepping: bool = False) -> dict[str, Any] | None:
        """The whole run, however it ends: the state (and the recording) always get a final event, the
        engine's own or one written here from the exception that ended the worker."""
        if self.session.finished or self.state.status in ("failed", "cancelled"):
            self._fresh_session()  # a finished run is kept on screen; a new one starts from scratch
        self._in_flight = True
        self.pending = None
        ending = RunEnding()
        error: BaseException | None = None
        try:
            if not self.session.built:
                self.state.status = "starting"
                self.post_state()
                built = await asyncio.to_thread(self.session.build)
                self.state.seed_holders(self.session.holder_names)
                for name in self.session.holder_names:
                    self.state.holders[name].state = HolderState.CONNECTING
                self._open_recorder(built)
                self.post_state()
            engine = self.session.engine
            assert engine is not None
            out = getattr(engine, "out_dir", None)  # status.json: the run's final word, recorded or not
            ending.out_dir = Path(out) if out is not None else None
            if stepping:
                self.session.pause()
                self.session.step()
            queue = engine.subscribe()
            engine.bus.sinks.append(self.tracker)
            if self.recorder is not None:
                engine.bus.sinks.append(self.recorder)
            engine.bus.sinks.append(ending)
            pump = asyncio.create_task(self._pump(queue))
            try:
                self.report = (await self.session.run()).to_json()
                return self.report
            finally:
                await asyncio.sleep(0)
                self._drain(queue)
                pump.cancel()
        except GpuTravelError as exc:
            error = exc
            if exc.code != "cancelled":
                self.notice(f"run failed: {exc}", "error")
            return None
        except BaseException as exc:  # the worker's exception is the run's end: say so, then let it go on
            error = exc
            if not isinstance(exc, asyncio.CancelledError):
                self.notice(f"run failed: {type(exc).__name__}: {exc}", "error")
            raise
        finally:
            self._in_flight = False
            made = ending.finish(error, recorder=self.recorder)
            if made is not None and self.state.status not in TERMINAL_STATUSES:
                self.fold((made,))
            elif error is not None and self.state.status not in TERMINAL_STATUSES:
                self.fold((ev.RunFailed(time.time(), self.state.run_id or "-", str(error) or type(error).__name__,
                                        ending_code(error)),))
            if error is not None and not self.session.finished:
                await asyncio.to_thread(self.session.close)  # a run that never started still stops its device
            self.receipts_from_ledger()
            self.post_state()

    def _fresh_session(self) -> None:
        old = self.session
        self.session = Session(self.engine_factory)
        self.session.breakpoints = set(old.breakpoints)
        self.state = RunState(breakpoints=set(self.state.breakpoints))
        self.tracker = interval_tracker()
        self._close_recorder()

    async def _pump(self, queue: asyncio.Queue[ev.Event]) -> None:
        while True:
            first = await queue.get()
            batch = [first]
            while not queue.empty():
                batch.append(queue.get_nowait())
            self.fold(batch)
            self.sync_control(post=False)
            self.post_state(tuple(batch))

    def fold(self, events: Iterable[ev.Event]) -> tuple[ev.Event, ...]:
        # the tracker is an engine sink here (it tags telemetry at once); only the state folds
        batch = tuple(events)
        for event in batch:
            self.state.apply(event)
        self.toast(batch)
        return batch

    def _drain(self, queue: asyncio.Queue[ev.Event]) -> None:
        batch = []
        while not queue.empty():
            batch.append(queue.get_nowait())
        if batch:
            self.fold(batch)
            self.post_state(tuple(batch))

    def sync_control(self, *, post: bool = True) -> bool:
        """The engine emits no event when a step ends; read its control state (called on a short timer)."""
        at = self.session.paused_at() if self._in_flight else None
        if at == self.state.paused_before:
            return False
        if at is None and self.state.status != "paused":
            return False
        self.state.set_paused(at)
        if post:
            self.post_state()
        return True

    # --- recording ------------------------------------------------------------------------------
    def _open_recorder(self, engine: Any) -> None:
        if self.record is False:
            return
        folder = RunFolder(engine.out_dir)
        path = folder.recording if self.record is True else Path(self.record)
        settings = engine.settings.to_dict() if hasattr(engine.settings, "to_dict") else {}
        self.recorder = Recorder(path, meta={"source": "gputravel-console", "settings": settings,
                                             "ledger": str(folder.ledger),
                                             "holders": list(engine.links), "started_at": time.time(),
                                             "pid": os.getpid()})

    def _close_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    # --- telemetry (awaited inside the app's "telemetry-poll" worker) --------------------------
    async def poll_telemetry(self, interval: float) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(interval)

    async def sample_once(self) -> TelemetryFrame:
        assert self.sampler.emulated is not None
        self.sampler.emulated.follow(self.session)
        frame = await asyncio.to_thread(self.sampler.collect, phase=self.tracker.tag)
        if self.recorder is not None:
            self.recorder.record_telemetry(frame)
        self.offer_frame(frame)
        return frame

    # --- controls -------------------------------------------------------------------------------
    @property
    def badges(self) -> tuple[str, ...]:
        status = self.latest_frame.nvml if self.latest_frame else None
        sim = self.state.sim or (status is not None and not status.available)
        return ("SIM",) if sim else ()

    def step(self) -> bool:
        if not self._in_flight:
            return False
        self.session.step()
        return True

    def toggle_pause(self) -> str:
        if not self._in_flight:
            return "no run in progress: r runs, space steps"
        engine = self.session.engine
        if engine is not None and engine.control.paused:
            self.resume()
            return "resumed"
        self.session.pause()
        if not self.state.paused_before:
            self.pending = "pausing"
            self.post_state()
        return "pausing: after the current training step, else before the next phase"

    def resume(self) -> None:
        self.session.resume()
        if self.pending == "pausing":
            self.pending = None
        self.state.set_paused(None)
        self.post_state()

    def toggle_breakpoint(self, phase: Phase, *, post: bool = True) -> bool:
        on = self.session.toggle_breakpoint(phase)
        (self.state.breakpoints.add if on else self.state.breakpoints.discard)(str(phase))
        if post:
            self.post_state()
        return on

    def cancel(self) -> None:
        self.session.cancel()
        if self._in_flight and not self.state.ended:
            self.pending = "cancelling"
            self.post_state()

    def close(self) -> None:
        self.session.close()
        self._close_recorder()
        self.sampler.close()
