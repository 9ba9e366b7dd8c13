"""The live bridge: a run this console drives in-process (``gputravel-console`` without ``--replay``).

:class:`LiveBridge` holds a :class:`~gputravel.core.session.Session` (which builds the engine off the loop and
steers it), a telemetry :class:`~gputravel.core.telemetry.Sampler` and the run's
:class:`~gputravel.core.recording.Recorder`; it pumps the engine's events into the view state.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.console.cli.run_end import RunEnding, ending_code
from gputravel.console.run_telemetry import interval_tracker
from gputravel.console.tui.bridge import Bridge
from gputravel.console.view.model import TERMINAL_STATUSES, RunState
from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError
from gputravel.core.phases import Phase
from gputravel.core.recording import Recorder
from gputravel.core.runfolder import RunFolder
from gputravel.core.session import Session
from gputravel.core.telemetry import EmulatedSource, Sampler, TelemetryFrame
from gputravel.core.travel.holders import HolderState

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["LiveBridge", "LiveFeed", "open_recorder"]


def open_recorder(engine: Any, record: Path | bool) -> Recorder | None:
    """The run's recording (``record``: True, in its run folder; a path; False, none), its meta naming the run."""
    if record is False:
        return None
    folder = RunFolder(engine.out_dir)
    path = folder.recording if record is True else Path(record)
    settings = engine.settings.to_dict() if hasattr(engine.settings, "to_dict") else {}
    return Recorder(path, meta={"source": "gputravel-console", "settings": settings, "ledger": str(folder.ledger),
                                "holders": list(engine.links), "started_at": time.time(), "pid": os.getpid()})


class LiveFeed:
    """What a live run records beside its state: the recording (``record``: see ``open_recorder``) and the telemetry
    sampler (this machine's NVML, the emulated GPU following the session), closed with the bridge."""

    def __init__(self, sampler: Sampler | None, record: Path | bool) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        if self.sampler.emulated is None:
            self.sampler.emulated = EmulatedSource()
        self.record = record
        self.recorder: Recorder | None = None

    def open(self, engine: Any) -> None:
        self.recorder = open_recorder(engine, self.record)

    def close_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    async def sample(self, session: Session, tag: str | None) -> TelemetryFrame:
        """One telemetry frame (recorded when the run is)."""
        assert self.sampler.emulated is not None
        self.sampler.emulated.follow(session)
        frame = await asyncio.to_thread(self.sampler.collect, phase=tag)
        if self.recorder is not None:
            self.recorder.record_telemetry(frame)
        return frame

    def close(self) -> None:
        self.close_recorder()
        self.sampler.close()


class LiveBridge(Bridge):
    """A live run: builds the engine off the loop, pumps its events, samples telemetry."""

    live = True

    def __init__(self, app: App[Any], *, engine_factory: Callable[[], Any], sampler: Sampler | None = None,
                 record: Path | bool = True) -> None:
        super().__init__(app)
        self.engine_factory = engine_factory
        self.session = Session(engine_factory)
        self.feed = LiveFeed(sampler, record)  # the recording and the telemetry sampler
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
                self.feed.open(built)
                self.post_state()
            engine = self.session.engine
            assert engine is not None
            ending.out_dir = engine.out_dir  # status.json: the run's final word, recorded or not
            if stepping:
                self.session.pause()
                self.session.step()
            queue = engine.subscribe()
            engine.bus.sinks.append(self.tracker)
            if self.feed.recorder is not None:
                engine.bus.sinks.append(self.feed.recorder)
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
            made = ending.finish(error, recorder=self.feed.recorder)
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
        self.feed.close_recorder()

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

    # --- telemetry (awaited inside the app's "telemetry-poll" worker) --------------------------
    async def poll_telemetry(self, interval: float) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(interval)

    async def sample_once(self) -> TelemetryFrame:
        frame = await self.feed.sample(self.session, self.tracker.tag)
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
        self.feed.close()
