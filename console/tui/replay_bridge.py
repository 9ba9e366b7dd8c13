"""The bridge that plays a recording (``gputravel-console --replay``), with the live bridge's controls moving the
view only; :class:`gputravel.console.tui.fleet_view.FleetBridge` extends it to a fleet's merged recordings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.console.run_telemetry import interval_tracker
from gputravel.console.tui.bridge import Bridge
from gputravel.console.view.model import RUN_EVENTS, TERMINAL_STATUSES, RunState
from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError
from gputravel.core.phases import Phase
from gputravel.core.recording import Player, RecordedItem, Recording, load_recording

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["ReplayBridge"]


class ReplayBridge(Bridge):
    """Plays a recording: step one phase, play / pause, jump to a visit or to either end.

    Every control here moves the view only (a recording has no run to steer), so all of them work in
    ``--readonly`` too. Following a recording still being written, ``end`` (and ``]`` past the last visit, and
    ``p`` / ``space`` that reach the end) go back to the live end and keep following; what has been written is
    read also while the view is paused, so the run's status (:meth:`shown_status`) is the recording's newest,
    never the paused view's."""

    replay = True

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
    def paused(self) -> bool:
        return self.state.status == "paused" or not self.playing

    def begin(self) -> None:
        if self.follow:  # like tail -f: the live end at once, not the run's history replayed (Home and [ go back)
            self.seek_end()
            self.playing = True

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
