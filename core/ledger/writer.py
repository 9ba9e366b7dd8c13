"""The ledger's one writer: appends chained rows and the engine's progress state in one transaction.

Durability: every append is committed at once (WAL, ``synchronous=NORMAL``), so a killed process loses nothing; it
reaches the disk (the WAL fsynced) where something relies on it surviving a power loss too (``flush``): before any
head is read (``head``: what a holder's witness, a receipt or a checkpoint records), with every row that carries the
engine's progress ``state``, and at ``close``. Rows in between are flushed with the next of those, so a power loss
can take back only rows nobody outside this process has seen and no progress. One fsync per row (``synchronous=FULL``,
before session 14) cost about 4 ms of the event loop on the build machine, several of them inside a hand-off
(docs/performance.md, "Session 14")."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from gputravel.core.errors import LedgerError
from gputravel.core.files import storage_error
from gputravel.core.ledger.rows import (
    _COLUMNS,
    _PAGE,
    _SCHEMA,
    _SELECT,
    GENESIS_HASH,
    HASHED_FIELDS,
    SCHEMA_VERSION,
    LedgerRow,
    _check_detail,
    _opt_float,
    _opt_int,
    _opt_text,
    _row_from_db,
    canonical_json,
    row_hash,
)


class Ledger:
    """An open ledger: one SQLite connection, shared across threads behind a lock.

    Open with :meth:`Ledger.open`; use as a context manager or call :meth:`close`.
    """

    def __init__(self, connection: sqlite3.Connection, *, path: Path, run_id: str) -> None:
        self._db = connection
        self._lock = threading.RLock()
        self._closed = False
        #: rows committed since the WAL was last fsynced (``flush``)
        self._unflushed = False
        self.path = path
        self.run_id = run_id

    @classmethod
    def open(cls, path: Path, *, run_id: str | None = None) -> Ledger:
        """Create or open the ledger at ``path``. ``run_id`` defaults to a fresh random id.

        Raises:
            LedgerError: the file is not a ledger, or was written by a newer schema.
        """
        path = Path(path)
        try:
            connection = sqlite3.connect(
                path, timeout=30.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
        try:
            connection.execute("PRAGMA foreign_keys=ON")
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"ledger {path}: WAL journal mode refused (got {mode!r})")
            connection.execute("PRAGMA synchronous=NORMAL")  # committed at once, fsynced by ``flush``
            _create_schema(connection, path)
        except sqlite3.Error as exc:
            connection.close()
            raise LedgerError(f"{path} is not a gputravel ledger: {exc}") from exc
        except BaseException:
            connection.close()
            raise
        return cls(connection, path=path, run_id=run_id if run_id is not None else uuid.uuid4().hex)

    # -- writing -------------------------------------------------------------------------------
    def append(
        self,
        *,
        kind: str,
        phase: str | None = None,
        holder: str | None = None,
        epoch: int | None = None,
        key_fp: str | None = None,
        nbytes: int | None = None,
        duration_s: float | None = None,
        outcome: str = "ok",
        detail: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
        ts: float | None = None,
    ) -> LedgerRow:
        """Append one event and upsert ``state`` in one transaction; return the stored row.

        Raises:
            LedgerError: a field has the wrong type, ``detail`` looks like key material or is not plain
                JSON, a ``state`` value is not JSON, or the database refused the write. Nothing is
                written in any of these cases.
            DiskFullError: no space for the row (SQLite's SQLITE_FULL, ENOSPC); ``StorageError``: another
                I/O failure of the write. The transaction is rolled back: the chain ends at the last row
                committed, and appending goes on once space is back.
        """
        kind_text = _opt_text(kind, "kind")
        outcome_text = _opt_text(outcome, "outcome")
        if not kind_text:
            raise LedgerError("kind must be a non-empty string")
        if not outcome_text:
            raise LedgerError("outcome must be a non-empty string")
        detail_map: Mapping[str, Any] = {} if detail is None else detail
        if not isinstance(detail_map, Mapping):
            raise LedgerError(f"detail must be a mapping, not {type(detail_map).__name__}")
        _check_detail(detail_map, "detail")
        try:
            detail_text = canonical_json(detail_map)
        except (TypeError, ValueError) as exc:
            raise LedgerError(f"detail is not JSON: {exc}") from exc
        stamp = _opt_float(time.time() if ts is None else ts, "ts")
        assert stamp is not None
        fields: dict[str, Any] = {
            "ts": stamp,
            "run_id": self.run_id,
            "kind": kind_text,
            "phase": _opt_text(phase, "phase"),
            "holder": _opt_text(holder, "holder"),
            "epoch": _opt_int(epoch, "epoch"),
            "key_fp": _opt_text(key_fp, "key_fp"),
            "nbytes": _opt_int(nbytes, "nbytes"),
            "duration_s": _opt_float(duration_s, "duration_s"),
            "outcome": outcome_text,
            "detail": detail_text,
        }
        state_items = list((state or {}).items())
        for name, _ in state_items:
            if not isinstance(name, str):
                raise LedgerError(f"state name {name!r} is not a string")

        with self._lock:
            self._check_open()
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    last = db.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
                    seq, prev = (1, GENESIS_HASH) if last is None else (int(last[0]) + 1, str(last[1]))
                    fields["seq"] = seq
                    digest = row_hash(prev, fields)
                    db.execute(
                        f"INSERT INTO events ({', '.join(_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(_COLUMNS))})",
                        [*(fields[name] for name in HASHED_FIELDS), prev, digest],
                    )
                    # Serialised inside the transaction: whatever fails here takes the event with it.
                    for name, value in state_items:
                        db.execute(
                            "INSERT INTO state (key, value) VALUES (?, ?) "
                            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                            (name, _state_json(name, value)),
                        )
                    db.execute("COMMIT")
                    self._unflushed = True
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                if _storage_failure(exc):
                    raise storage_error(exc, f"ledger {self.path}: append of {kind_text!r}") from exc
                raise LedgerError(f"ledger {self.path}: append failed: {exc}") from exc
            if state_items:  # the engine's progress: on disk before the engine goes on
                self.flush()
        return LedgerRow(
            **{name: fields[name] for name in HASHED_FIELDS if name != "detail"},
            detail=json.loads(detail_text),
            prev_hash=prev,
            hash=digest,
        )

    # -- reading -------------------------------------------------------------------------------
    def get_state(self, key: str, default: Any = None) -> Any:
        """The JSON value last stored under ``key``, or ``default``."""
        with self._lock:
            self._check_open()
            found = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return default if found is None else json.loads(found[0])

    def state_items(self) -> dict[str, Any]:
        """Every state item, parsed."""
        with self._lock:
            self._check_open()
            found = self._db.execute("SELECT key, value FROM state ORDER BY key").fetchall()
        return {str(key): json.loads(value) for key, value in found}

    def rows(self, since_seq: int = 0) -> Iterator[LedgerRow]:
        """Rows with ``seq > since_seq`` in order, read a page at a time (the lock is not held between)."""
        cursor_seq = since_seq
        while True:
            with self._lock:
                self._check_open()
                page = self._db.execute(
                    f"{_SELECT} WHERE seq > ? ORDER BY seq LIMIT ?", (cursor_seq, _PAGE)
                ).fetchall()
            if not page:
                return
            for values in page:
                row = _row_from_db(values)
                cursor_seq = row.seq
                yield row

    def max_epoch(self) -> int:
        """The highest epoch any row names (0 when none does)."""
        with self._lock:
            self._check_open()
            (epoch,) = self._db.execute("SELECT MAX(epoch) FROM events").fetchone()
        return int(epoch or 0)

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last row; ``(0, GENESIS_HASH)`` when empty. Flushed first: a head handed out (a
        holder's witness, a receipt, a checkpoint's) is one no power loss can take back."""
        with self._lock:
            self._check_open()
            self.flush()
            last = self._db.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        return (0, GENESIS_HASH) if last is None else (int(last[0]), str(last[1]))

    # -- durability ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Every committed row on disk: the WAL fsynced (nothing to do when no row came since the last flush).

        Raises:
            DiskFullError, StorageError: the disk refused the flush (the rows stay committed; a later flush tries
                again).
        """
        with self._lock:
            self._check_open()
            if not self._unflushed:
                return
            wal = self.path.with_name(self.path.name + "-wal")
            try:
                fd = os.open(wal, os.O_RDONLY)
            except FileNotFoundError:  # checkpointed and removed: the database file itself was synced
                fd = -1
            except OSError as exc:
                raise storage_error(exc, f"ledger {self.path}: flush") from exc
            if fd >= 0:
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise storage_error(exc, f"ledger {self.path}: flush") from exc
                finally:
                    os.close(fd)
            self._unflushed = False

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the connection (idempotent)."""
        with self._lock:
            if not self._closed:
                try:
                    self.flush()
                finally:
                    self._closed = True
                    self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"ledger {self.path} is closed")


#: SQLite's primary result codes that mean the storage under the ledger failed, not the ledger itself:
#: SQLITE_IOERR (10), SQLITE_FULL (13), SQLITE_CANTOPEN (14, a -wal/-shm that cannot be created)
_STORAGE_CODES = frozenset({10, 13, 14})


def _storage_failure(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF in _STORAGE_CODES


def _state_json(name: str, value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        raise LedgerError(f"state {name!r}: bytes are not recorded (only JSON values)")
    try:
        return canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"state {name!r} is not JSON: {exc}") from exc


def _create_schema(connection: sqlite3.Connection, path: Path) -> None:
    connection.execute("BEGIN IMMEDIATE")
    try:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                connection.execute(statement)
        found = connection.execute("SELECT version FROM schema_version").fetchall()
        if not found:
            connection.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        elif len(found) != 1 or found[0][0] != SCHEMA_VERSION:
            raise LedgerError(
                f"ledger {path} has schema version {[v for (v,) in found]}, this gputravel reads "
                f"{SCHEMA_VERSION}"
            )
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


# --- read-only access -----------------------------------------------------------------------
