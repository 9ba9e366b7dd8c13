"""Playing a recording in the console: the part every recording bridge (replay, fleet, attached, launched) holds.

:class:`Playback` owns where the view is and how it moves: the
:class:`~gputravel.console.view.recorded_run.RecordedRun` (the cursor, the run's own state), whether it plays,
its pace, and whether it follows a recording still being written. It folds what it plays into the view through
its host, the bridge (:class:`PlaybackHost`: the bridge owns the view state and says what reading more means:
an attached bridge also checks who steers, a launched one whether its process ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

from gputravel.console.view.model import RunState
from gputravel.console.view.recorded_run import RecordedRun
from gputravel.core import events as ev
from gputravel.core.recording import Player, RecordedItem
from gputravel.core.telemetry import TelemetryFrame

__all__ = ["Playback", "PlaybackHost"]


class PlaybackHost(Protocol):
    """What a playback asks of the bridge that holds it (the bridge owns the view state)."""

    def fold(self, events: Iterable[ev.Event]) -> tuple[ev.Event, ...]: ...

    def offer_frame(self, frame: TelemetryFrame) -> None: ...

    def new_state(self) -> RunState:
        """The empty state a rebuild (a jump) folds the played items into."""
        ...

    def reset_view(self, state: RunState) -> None: ...

    def follow_more(self) -> bool:
        """Read what the run appended since; True when something changed."""
        ...

    def shown_status(self) -> str | None: ...

    def post_state(self, events: tuple[ev.Event, ...] = (), *, reset: bool = False) -> None: ...


#: How played items go into the view (a fleet's: each with its GPU); the events folded
Apply = Callable[[Iterable[RecordedItem]], tuple[ev.Event, ...]]


class Playback:
    """Step one phase, play / pause, jump to a visit or to either end, over one recording.

    Following a recording still being written, the end (and a jump past the last visit, and a step that reaches
    the end) is the live end: playing there keeps following; what has been written is read also while the view
    is paused (:meth:`play`), so the run's status is the recording's newest, never the paused view's."""

    def __init__(self, host: PlaybackHost, recorded: RecordedRun, *, speed: float = 8.0, follow: bool = False,
                 apply: Apply | None = None) -> None:
        self.host = host
        self.recorded = recorded
        self.apply: Apply = apply if apply is not None else self.fold_items
        self.speed = speed
        self.follow = follow
        self.playing = False

    def fold_items(self, items: Iterable[RecordedItem]) -> tuple[ev.Event, ...]:
        """Events folded into the host's view, telemetry offered to it (as the replay's)."""
        events: list[ev.Event] = []
        for item in items:
            if item.kind == "event":
                events.extend(self.host.fold((item.event(),)))
            elif item.kind == "telemetry":
                frame = item.frame()  # a followed run's frames are its live sampler's, not a replay's
                source = f"{frame.source} · read from the run's recording" if self.follow else "replay"
                self.host.offer_frame(frame.replace(source=source))
        return tuple(events)

    def load(self, recorded: RecordedRun) -> None:
        """Play another recording from its start (a run the console just started), playing on."""
        self.recorded = recorded
        self.playing = True

    @property
    def player(self) -> Player:
        return self.recorded.player

    @property
    def end_state(self) -> RunState:
        """The run as the whole recording tells it so far (run-level events only): its status is the truth."""
        return self.recorded.end_state

    @property
    def at_end(self) -> bool:
        return self.recorded.at_end

    def badge(self) -> str:
        return self.recorded.badge(playing=self.playing, follow=self.follow)

    def begin(self) -> None:
        if self.follow:  # like tail -f: the live end at once, not the run's history replayed (Home and [ go back)
            self.seek_end()
            self.playing = True

    def step(self) -> None:
        """One phase on (following, at the live end: what the run appended first; there, follow again)."""
        self.playing = False
        if self.follow and self.at_end:
            self.host.follow_more()
        self.host.post_state(self.apply(self.player.step_phase()))
        if self.follow and self.at_end:
            self.playing = True  # stepped up to the live end: follow again

    def toggle(self) -> str:
        self.playing = not self.playing
        self.host.post_state()
        if self.follow:
            return "following" if self.playing else "paused (the run goes on: end or p follows it again)"
        return "playing" if self.playing else "paused"

    def stop(self) -> None:
        self.playing = False
        self.host.post_state()

    def restart(self) -> None:
        self.seek(0)
        self.playing = True

    def seek(self, position: int) -> None:
        """Show the recording as it stood after ``position`` items (the view rebuilt from the start)."""
        self.player.seek(position)
        self.host.reset_view(self.host.new_state())
        self.apply(self.player.played())
        self.host.post_state(reset=True)

    def seek_end(self) -> None:
        """To the end: of a finished recording, or (following) the live end, and keep following it."""
        if self.follow:
            self.host.follow_more()
        self.seek(len(self.player.items))
        self.playing = self.follow
        self.host.post_state()

    def jump_visit(self, visit: int) -> None:
        """Jump to the start of ``visit`` (0-based), so the header names it and ``]`` moves on from it; a visit
        past the last one means the end (following: the live end, followed again)."""
        start = self.recorded.visit_start(visit)
        if start is not None:
            self.seek(start)
        else:
            self.seek_end()

    def at_visit_start(self, visit: int) -> bool:
        """The cursor sits where :meth:`jump_visit` puts it for ``visit``."""
        start = self.recorded.visit_start(visit)
        return start is not None and self.player.position == start

    def current_visit(self) -> int:
        return self.recorded.current_visit()

    async def play(self) -> None:
        """Awaited inside the app's "replay" worker: advance while playing, pacing by the recorded times;
        following, read what the run appended every half second, also while the view is paused."""
        last_t: float | None = None
        next_read = 0.0
        loop = asyncio.get_running_loop()
        host = self.host
        while True:
            if self.follow and loop.time() >= next_read:
                next_read = loop.time() + 0.5
                before = host.shown_status()
                if host.follow_more() or host.shown_status() != before:
                    host.post_state()
            if not self.playing:
                await asyncio.sleep(0.05)
                continue
            item = self.player.next()
            if item is None:
                if self.follow:
                    await asyncio.sleep(0.1)
                    continue
                self.playing = False
                host.post_state()
                continue
            gap = 0.0 if last_t is None else max(0.0, min(item.t - last_t, 2.0)) / self.speed
            last_t = item.t
            if gap:
                await asyncio.sleep(gap)
            host.post_state(self.apply([item]))
