"""The one bridge between a run and the console: engine events in, Textual messages out.

:class:`LiveBridge` drives a real engine (through :class:`~gputravel.core.session.Session`) and samples
telemetry; :class:`ReplayBridge` plays a recording with the same controls. Both fold events into one
:class:`~gputravel.console.view_model.RunState` that the screens render, and both coalesce telemetry: a frame
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

from gputravel.console.run_end import RunEnding, ending_code
from gputravel.console.run_telemetry import interval_tracker
from gputravel.console.view_model import RUN_EVENTS, TERMINAL_STATUSES, RunState
from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError
from gputravel.core.ledger import read_rows
from gputravel.core.recording import Player, RecordedItem, Recorder, Recording, load_recording
from gputravel.core.session import Session
from gputravel.core.telemetry import EmulatedSource, History, Sampler, TelemetryFrame
from gputravel.core.travel.holders import HolderState
from gputravel.core.travel.phases import Phase

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["Bridge", "LiveBridge", "ReplayBridge"]


class Bridge:
    """What every bridge offers the app: state, telemetry, and the operator's controls."""

    live = False

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
        return Path(out) / "ledger.db" if out is not None else None

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
            engine.sinks.append(self.tracker)
            if self.recorder is not None:
                engine.sinks.append(self.recorder)
            engine.sinks.append(ending)
            pump = asyncio.create_task(self._pump(queue))
            try:
                self.report = await self.session.run()
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
        path = Path(engine.out_dir) / "recording.db" if self.record is True else Path(self.record)
        settings = engine.settings.to_dict() if hasattr(engine.settings, "to_dict") else {}
        self.recorder = Recorder(path, meta={"source": "gputravel-console", "settings": settings,
                                             "ledger": str(Path(engine.out_dir) / "ledger.db"),
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


class ReplayBridge(Bridge):
    """Plays a recording: step one phase, play / pause, jump to a visit or to either end.

    Every control here moves the view only (a recording has no run to steer), so all of them work in
    ``--readonly`` too. Following a recording still being written, ``end`` (and ``]`` past the last visit, and
    ``p`` / ``space`` that reach the end) go back to the live end and keep following; what has been written is
    read also while the view is paused, so the run's status (:meth:`shown_status`) is the recording's newest,
    never the paused view's."""

    def __init__(self, app: App[Any], recording: Recording, *, speed: float = 8.0, follow: bool = False) -> None:
        super().__init__(app)
        self.player = Player(recording)
        self.playing = False
        self.speed = speed
        self.follow = follow
        self.state.breakpoints = set()
        #: the run as the whole recording tells it so far (run-level events only): its status is the truth
        self.end_state = self.new_state()
        self.meta_status: str | None = None
        self._fold_end(self.player.items)

    @property
    def ledger_path(self) -> Path | None:
        path = self.player.recording.meta.get("ledger")
        return Path(path) if path else None

    @property
    def running(self) -> bool:
        return self.playing

    @property
    def at_end(self) -> bool:
        return self.player.position >= len(self.player.items)

    @property
    def badges(self) -> tuple[str, ...]:
        return (*super().badges, self.position_badge())

    def position_badge(self) -> str:
        """``REPLAY ▶ 12/40``; following, ``FOLLOW ▶`` at the live end (a position there says little) or
        ``FOLLOW ‖ 12/40`` where the view was paused or moved back."""
        mode = "▶" if self.playing else "‖"
        where = f"{self.player.position}/{len(self.player.items)}"
        if self.follow:
            return f"FOLLOW {mode}" if self.playing else f"FOLLOW {mode} {where}"
        return f"REPLAY {mode} {where}"

    def _fold_end(self, items: Iterable[RecordedItem]) -> None:
        for item in items:
            if item.kind == "event" and item.name in RUN_EVENTS:
                self._fold_end_event(item)

    def _fold_end_event(self, item: RecordedItem) -> None:
        self.end_state.apply(item.event())

    def shown_status(self) -> str | None:
        """The run's status from the recording's newest run event (its final one once written); else, for a
        recording the run could not end (no final event), the status its meta holds."""
        status = self.end_state.status
        if status in TERMINAL_STATUSES:
            return str(status)
        if self.meta_status in TERMINAL_STATUSES | {"partial"}:
            return self.meta_status
        if status == "paused" and self.end_state.paused_before:
            return f"paused before {self.end_state.paused_before}"
        if status == "idle" and self.follow:
            return "starting"  # following a run that has not written its first run event yet
        return str(status) if status != "idle" else None

    def _apply(self, items: Iterable[RecordedItem]) -> tuple[ev.Event, ...]:
        events: list[ev.Event] = []
        for item in items:
            if item.kind == "event":
                events.extend(self.fold((item.event(),)))
            elif item.kind == "telemetry":
                self.offer_frame(item.frame().replace(source="replay"))
        return tuple(events)

    def step(self) -> bool:
        self.playing = False
        if self.follow and self.at_end:
            self.follow_more()
        self.post_state(self._apply(self.player.step_phase()))
        if self.follow and self.at_end:
            self.playing = True  # stepped up to the live end: follow again
        return True

    def toggle_pause(self) -> str:
        self.playing = not self.playing
        self.post_state()
        if self.follow:
            return "following" if self.playing else "paused (the run goes on: end or p follows it again)"
        return "playing" if self.playing else "paused"

    def toggle_breakpoint(self, phase: Phase) -> bool:
        raise GpuTravelError("breakpoints belong to a live run")

    def cancel(self) -> None:
        self.playing = False
        self.post_state()

    def restart(self) -> None:
        self.seek(0)
        self.playing = True

    def seek(self, position: int) -> None:
        self.player.seek(position)
        self.rebuild()

    def seek_end(self) -> None:
        """To the end: of a finished recording, or (following) the live end, and keep following it."""
        if self.follow:
            self.follow_more()
        self.seek(len(self.player.items))
        self.playing = self.follow
        self.post_state()

    def jump_visit(self, visit: int) -> None:
        """Jump to the start of ``visit`` (0-based): its first phase (ATTEST) has begun, so the header names
        that visit and ``]`` moves on from it; a visit past the last one means the end (following: the live
        end, followed again)."""
        starts = self.player.visit_starts()
        if 0 <= visit < len(starts):
            self.seek(starts[visit] + 1)
        else:
            self.seek_end()

    def at_visit_start(self, visit: int) -> bool:
        """The cursor sits where :meth:`jump_visit` puts it for ``visit``."""
        starts = self.player.visit_starts()
        return 0 <= visit < len(starts) and self.player.position == starts[visit] + 1

    def current_visit(self) -> int:
        """The visit (0-based) the cursor is in; -1 before the first one starts."""
        return sum(1 for s in self.player.visit_starts() if s < self.player.position) - 1

    def new_state(self) -> RunState:
        """The empty state a rebuild (a jump) folds the played items into."""
        return RunState(breakpoints=set())

    def rebuild(self) -> None:
        self.state = self.new_state()
        self.history.clear()
        self.tracker = interval_tracker()
        self.latest_frame = self.last_devices = None
        self._apply(self.player.played())
        self.post_state(reset=True)

    async def play(self) -> None:
        """Awaited inside the app's "replay" worker: advance while playing, pacing by the recorded times;
        following, read what the run appended every half second, also while the view is paused."""
        last_t: float | None = None
        next_read = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if self.follow and loop.time() >= next_read:
                next_read = loop.time() + 0.5
                before = self.shown_status()
                if self.follow_more() or self.shown_status() != before:
                    self.post_state()
            if not self.playing:
                await asyncio.sleep(0.05)
                continue
            item = self.player.next()
            if item is None:
                if self.follow:
                    await asyncio.sleep(0.1)
                    continue
                self.playing = False
                self.post_state()
                continue
            gap = 0.0 if last_t is None else max(0.0, min(item.t - last_t, 2.0)) / self.speed
            last_t = item.t
            if gap:
                await asyncio.sleep(gap)
            self.post_state(self._apply([item]))

    def follow_more(self) -> bool:
        """Read what the run appended since (following); True when there was something."""
        last = self.player.items[-1].seq if self.player.items else 0
        try:
            rec = load_recording(self.player.recording.path, since_seq=last)
        except GpuTravelError:
            return False
        status = rec.meta.get("status")
        self.meta_status = status if isinstance(status, str) else None
        if rec.items:
            self.player.extend(rec.items)
            self._fold_end(rec.items)
        return bool(rec.items)
