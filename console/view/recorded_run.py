"""A recording as the console plays it: the player's cursor, and the run as the whole recording tells it so far.

:class:`RecordedRun` owns the :class:`~gputravel.core.recording.Player` (where the view is) and ``end_state``
(the run-level events of everything read so far: its status is the run's, whatever the view shows), and reads
what a followed run appended since. The replay, attached, launched and fleet bridges of the TUI each hold one;
it knows nothing of Textual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gputravel.console.view.fleet import RUN_EVENTS, TERMINAL_STATUSES
from gputravel.console.view.model import RunState
from gputravel.core.errors import GpuTravelError
from gputravel.core.recording import Player, RecordedItem, Recording, load_recording

__all__ = ["MoreItems", "RecordedRun"]

#: What a followed run appended since the last read, and its meta's status (None: it has none; the read failed:
#: raise a ``GpuTravelError`` and nothing changes)
MoreItems = Callable[[Player], tuple[tuple[RecordedItem, ...], str | None]]


def more_of_file(player: Player) -> tuple[tuple[RecordedItem, ...], str | None]:
    """The items appended to the player's recording file since its last item, and the status its meta holds."""
    last = player.items[-1].seq if player.items else 0
    rec = load_recording(player.recording.path, since_seq=last)
    status = rec.meta.get("status")
    return rec.items, status if isinstance(status, str) else None


class RecordedRun:
    """A recording's cursor and its run's own state (``end_state``, folded from run-level events only).

    ``new_state`` makes an empty view state (a fleet's knows its size); ``gpu_of`` says which GPU an item is of
    (None outside a fleet); ``more`` reads what the run appended (a fleet merges its ranks' files)."""

    def __init__(self, recording: Recording, *, new_state: Callable[[], RunState],
                 gpu_of: Callable[[RecordedItem], int | None] = lambda item: None, more: MoreItems = more_of_file) -> None:
        self.player = Player(recording)
        self.new_state = new_state
        self.gpu_of = gpu_of
        self._more = more
        self.end_state = new_state()
        #: the status the recording's meta holds (a run that could not write its final event says it there)
        self.meta_status: str | None = None
        #: how the run's folder says it ended where its recording cannot (a full disk refused the final event;
        #: set by the bridge that knows the folder: ``failed: disk full``, ``died``, ``unknown``)
        self.folder_status: str | None = None
        self.fold_end(self.player.items)

    def fold_end(self, items: Iterable[RecordedItem]) -> None:
        for item in items:
            if item.kind == "event" and item.name in RUN_EVENTS:
                self.end_state.apply(item.event(), gpu=self.gpu_of(item))

    def read_more(self) -> bool:
        """Read what the run appended since; True when there was something."""
        try:
            items, status = self._more(self.player)
        except GpuTravelError:
            return False
        self.meta_status = status
        if items:
            self.player.extend(items)
            self.fold_end(items)
        return bool(items)

    @property
    def at_end(self) -> bool:
        return self.player.position >= len(self.player.items)

    def status(self, *, follow: bool) -> str | None:
        """The run's status from the recording's newest run event (its final one once written); else, for a
        recording the run could not end (no final event), the status its meta holds."""
        status = self.end_state.status
        if status in TERMINAL_STATUSES:
            return str(status)
        if self.folder_status is not None:
            return self.folder_status
        if self.meta_status in TERMINAL_STATUSES | {"partial"}:
            return self.meta_status
        if status == "paused" and self.end_state.paused_before:
            return f"paused before {self.end_state.paused_before}"
        if status == "idle" and follow:
            return "starting"  # following a run that has not written its first run event yet
        return str(status) if status != "idle" else None

    def badge(self, *, playing: bool, follow: bool) -> str:
        """``REPLAY ▶ 12/40``; following, ``FOLLOW ▶`` at the live end (a position there says little) or
        ``FOLLOW ‖ 12/40`` where the view was paused or moved back."""
        mode = "▶" if playing else "‖"
        where = f"{self.player.position}/{len(self.player.items)}"
        if follow:
            return f"FOLLOW {mode}" if playing else f"FOLLOW {mode} {where}"
        return f"REPLAY {mode} {where}"

    def visit_start(self, visit: int) -> int | None:
        """Where the view shows the start of ``visit`` (0-based): its first phase (ATTEST) has begun, so the
        header names that visit; None past the last one."""
        starts = self.player.visit_starts()
        return starts[visit] + 1 if 0 <= visit < len(starts) else None

    def current_visit(self) -> int:
        """The visit (0-based) the cursor is in; -1 before the first one starts."""
        return sum(1 for s in self.player.visit_starts() if s < self.player.position) - 1
