"""Record and replay a run: engine events and telemetry frames in one SQLite file.

A :class:`Recorder` is an engine event sink (``engine.bus.sinks.append(recorder)``) and also takes telemetry
frames (:meth:`Recorder.record_telemetry`). :func:`load_recording` reads the file back;
:class:`Player` walks it with the controls an operator has on a live run (step one phase, play,
pause, jump to a visit, jump to a position).

Schema (version 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)            -- JSON values: settings, started_at, ...
    items(seq INTEGER PRIMARY KEY, t REAL, kind TEXT, -- kind: "event" | "telemetry"
          name TEXT, body TEXT)                       -- name: event class; body: JSON

Standard library only (plus this package's events and telemetry snapshots).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gputravel.core import events as ev
from gputravel.core.errors import RecordingError, StorageError
from gputravel.core.files import storage_error
from gputravel.core.protocol.wire import WireFormatError, WireMessage
from gputravel.core.telemetry.model import TelemetryFrame

__all__ = ["RECORDING_VERSION", "RecordedItem", "Recorder", "Recording", "Player", "RecordingError",
           "event_from_dict", "load_recording"]

RECORDING_VERSION: Final = 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    seq  INTEGER PRIMARY KEY,
    t    REAL NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


def _json_default(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


def event_from_dict(data: dict[str, Any]) -> ev.Event:
    """Rebuild an engine event from its ``to_dict()`` form; unknown fields are dropped, tuples restored."""
    kind = data.get("kind")
    cls = ev.event_types().get(str(kind))
    if cls is None:
        raise RecordingError(f"unknown event kind {kind!r}")
    if issubclass(cls, WireMessage):  # a typed payload: every field checked against its declared bounds
        try:
            return cls.from_wire(data)
        except WireFormatError as exc:
            raise RecordingError(f"{kind}: {exc.reason}") from None
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            if isinstance(value, list) and "tuple" in str(f.type):
                value = tuple(value)
            kw[f.name] = value
    try:
        return cls(**kw)
    except TypeError as exc:
        raise RecordingError(f"{kind}: {exc}") from None


@dataclass(frozen=True, slots=True)
class RecordedItem:
    seq: int
    t: float
    kind: str  # "event" | "telemetry"
    name: str
    body: dict[str, Any]

    def event(self) -> ev.Event:
        return event_from_dict(self.body)

    def frame(self) -> TelemetryFrame:
        return TelemetryFrame.from_dict(self.body)

    @property
    def phase_boundary(self) -> bool:
        """The last item of a phase: where a step in replay stops."""
        return self.kind == "event" and self.name in ("PhaseCompleted", "VisitFailed", "RunCompleted", "RunFailed")

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "t": self.t, "kind": self.kind, "name": self.name, "body": self.body}


class Recorder:
    """Appends events and telemetry to a recording; safe to call from the loop and from threads.

    A write the disk refuses (full: ``DiskFullError``; else ``StorageError``) ends the recording: it is
    raised once, from the next event recorded (so from the engine's sink, which stops the run with it;
    a telemetry tick only notes it), and everything after is dropped. What was written stays readable."""

    def __init__(self, path: Path, *, meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
        except sqlite3.Error as exc:
            raise RecordingError(f"cannot record to {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        self._closed = False
        self.items = 0
        #: the write the disk refused (the recording stopped there), and whether it was raised yet
        self.failed: StorageError | None = None
        self._failure_told = False
        self.set_meta({"version": RECORDING_VERSION, **(meta or {})})

    def set_meta(self, meta: dict[str, Any]) -> None:
        with self._lock:
            if self._closed or self.failed is not None:
                return
            try:
                self._db.executemany("INSERT INTO meta (key, value) VALUES (?, ?) "
                                     "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                                     [(k, json.dumps(v, default=_json_default)) for k, v in meta.items()])
            except sqlite3.Error as exc:
                self.failed = storage_error(exc, f"recording {self.path}")
                self._failure_told = True
                raise self.failed from exc

    def _append(self, t: float, kind: str, name: str, body: dict[str, Any], *, tell: bool) -> None:
        text = json.dumps(body, default=_json_default, allow_nan=False)
        with self._lock:
            if self._closed:
                return
            if self.failed is None:
                try:
                    self._db.execute("INSERT INTO items (t, kind, name, body) VALUES (?, ?, ?, ?)",
                                     (t, kind, name, text))
                    self.items += 1
                    return
                except sqlite3.Error as exc:
                    self.failed = storage_error(exc, f"recording {self.path}")
            if tell and not self._failure_told:
                self._failure_told = True
                raise self.failed

    def __call__(self, event: ev.Event) -> None:
        """An engine sink."""
        self.record_event(event)

    def record_event(self, event: ev.Event) -> None:
        self._append(event.t, "event", event.kind, event.to_dict(), tell=True)

    def record_telemetry(self, frame: TelemetryFrame) -> None:
        self._append(frame.t, "telemetry", frame.source, frame.to_dict(), tell=False)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()


@dataclass(frozen=True, slots=True)
class Recording:
    path: Path
    meta: dict[str, Any]
    items: tuple[RecordedItem, ...]

    def events(self) -> list[ev.Event]:
        return [i.event() for i in self.items if i.kind == "event"]

    def frames(self) -> list[TelemetryFrame]:
        return [i.frame() for i in self.items if i.kind == "telemetry"]

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "meta": self.meta,
                "events": [i.body for i in self.items if i.kind == "event"],
                "telemetry": [i.body for i in self.items if i.kind == "telemetry"]}


def load_recording(path: Path, *, since_seq: int = 0) -> Recording:
    """Read a recording (read-only; also while a console is still writing it)."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such recording")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise RecordingError(f"cannot open {path}: {exc}") from exc
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        rows = db.execute("SELECT seq, t, kind, name, body FROM items WHERE seq > ? ORDER BY seq", (since_seq,))
        items = tuple(RecordedItem(int(s), float(t), str(k), str(n), json.loads(b)) for s, t, k, n, b in rows)
    except (sqlite3.Error, ValueError) as exc:
        raise RecordingError(f"{path} is not a gputravel recording: {exc}") from exc
    finally:
        db.close()
    if meta.get("version") != RECORDING_VERSION:
        raise RecordingError(f"{path}: recording version {meta.get('version')!r}, this gputravel reads "
                             f"{RECORDING_VERSION}")
    return Recording(path, meta, items)


class Player:
    """A cursor over a recording. ``position`` is the number of items already played."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.position = 0

    @property
    def items(self) -> tuple[RecordedItem, ...]:
        return self.recording.items

    @property
    def at_end(self) -> bool:
        return self.position >= len(self.items)

    def extend(self, more: tuple[RecordedItem, ...]) -> None:
        """Items appended to the file since it was loaded (following a recording as it is written)."""
        self.recording = dataclasses.replace(self.recording, items=self.items + more)

    def next(self) -> RecordedItem | None:
        if self.at_end:
            return None
        item = self.items[self.position]
        self.position += 1
        return item

    def step_phase(self) -> list[RecordedItem]:
        """Play up to and including the end of the next phase (or the end of the run)."""
        out: list[RecordedItem] = []
        while (item := self.next()) is not None:
            out.append(item)
            if item.phase_boundary:
                break
        return out

    def played(self) -> Iterator[RecordedItem]:
        """Everything up to the cursor (what a view rebuilt after a jump must fold)."""
        return iter(self.items[: self.position])

    def seek(self, position: int) -> None:
        self.position = max(0, min(position, len(self.items)))

    def visit_starts(self) -> list[int]:
        """Positions at which each visit's first phase starts."""
        return [i for i, item in enumerate(self.items)
                if item.name == "PhaseStarted" and item.body.get("phase") == "ATTEST"]

    def seek_visit(self, visit: int) -> None:
        """Jump to just before visit ``visit`` (0-based) starts; past the last visit means the end."""
        starts = self.visit_starts()
        self.seek(starts[visit] if 0 <= visit < len(starts) else len(self.items))

    def current_visit(self) -> int:
        starts = self.visit_starts()
        return sum(1 for s in starts if s < self.position) - 1
