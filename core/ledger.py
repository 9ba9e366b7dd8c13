"""The hash-chained audit ledger: every phase of every visit, provable afterwards.

Each event is a row in an SQLite table whose ``hash`` is
``sha256(prev_hash_hex_ascii + canonical_json(fields))`` over the row's own fields (``seq``, ``ts``,
``run_id``, ``kind``, ``phase``, ``holder``, ``epoch``, ``key_fp``, ``nbytes``, ``duration_s``,
``outcome`` and the stored ``detail`` text), with ``prev_hash`` the previous row's hash (64 zeros for
the first row). Altering a field, breaking a link, deleting a row in the middle or reordering rows is
found by :func:`verify_ledger`, which opens the file read-only.

What the chain cannot show on its own: rows cut off the *end* (truncation) or a whole chain rewritten
from some row on. An operator proves those against a head ``(seq, hash)`` recorded elsewhere
(:meth:`Ledger.head`, printed as ``SEQ:HASH`` by ``gputravel run`` and ``gputravel ledger verify``), with
``verify_ledger(path, expect_head=...)`` or ``gputravel ledger verify --head SEQ:HASH``.

Keys appear only by fingerprint: :meth:`Ledger.append` refuses ``detail`` names that look like key
material (``key``, ``secret``, ``master``, ``private``, except ``key_fp``/``*_fp``/``*_fingerprint``) and any
value that is not plain JSON (bytes included).

The engine's progress (``state``) is upserted in the same transaction as the event that records it, so
after a crash the ledger and the progress it records never disagree.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from gputravel.core.errors import LedgerError

__all__ = [
    "GENESIS_HASH",
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerRow",
    "VerifyResult",
    "canonical_json",
    "parse_head",
    "read_rows",
    "read_state",
    "row_hash",
    "verify_ledger",
    "witnessed_heads",
]

SCHEMA_VERSION: Final = 1
GENESIS_HASH: Final = "0" * 64

#: The hashed fields of a row, in table order (``prev_hash`` enters as the prefix, ``hash`` is the result).
HASHED_FIELDS: Final = (
    "seq", "ts", "run_id", "kind", "phase", "holder", "epoch", "key_fp", "nbytes", "duration_s",
    "outcome", "detail",
)
_COLUMNS: Final = (*HASHED_FIELDS, "prev_hash", "hash")
_SELECT: Final = f"SELECT {', '.join(_COLUMNS)} FROM events"

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_KEYLIKE_WORDS: Final = ("key", "secret", "master", "private")
_FINGERPRINT_SUFFIXES: Final = ("_fp", "_fingerprint")
_PAGE: Final = 1000

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq        INTEGER PRIMARY KEY,
    ts         REAL    NOT NULL,
    run_id     TEXT,
    kind       TEXT    NOT NULL,
    phase      TEXT,
    holder     TEXT,
    epoch      INTEGER,
    key_fp     TEXT,
    nbytes     INTEGER,
    duration_s REAL,
    outcome    TEXT    NOT NULL,
    detail     TEXT    NOT NULL,   -- canonical JSON object
    prev_hash  TEXT    NOT NULL,
    hash       TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS events_holder ON events (holder);
CREATE TABLE IF NOT EXISTS state (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL            -- JSON
);
"""


# --- hashing --------------------------------------------------------------------------------
def canonical_json(obj: Any) -> str:
    """The one JSON spelling that is hashed: sorted keys, no spaces, UTF-8, no NaN/Infinity.

    Floats are written with ``repr`` (Python's shortest round-trip form), so a float read back from
    SQLite's 8-byte REAL hashes exactly as it did when it was appended.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def row_hash(prev_hash: str, fields: Mapping[str, Any]) -> str:
    """``sha256(prev_hash_hex_ascii + canonical_json(fields))`` as lowercase hex."""
    digest = hashlib.sha256(prev_hash.encode("ascii", errors="replace"))
    digest.update(canonical_json({name: fields[name] for name in HASHED_FIELDS}).encode("utf-8"))
    return digest.hexdigest()


# --- rows -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LedgerRow:
    """One event as stored: the fields, the chain link and the row's own hash."""

    seq: int
    ts: float
    run_id: str | None
    kind: str
    phase: str | None
    holder: str | None
    epoch: int | None
    key_fp: str | None
    nbytes: int | None
    duration_s: float | None
    outcome: str
    detail: dict[str, Any] = field(hash=False)
    prev_hash: str
    hash: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every column, ``detail`` parsed."""
        return {name: getattr(self, name) for name in _COLUMNS} | {"detail": dict(self.detail)}


def _row_from_db(values: tuple[Any, ...]) -> LedgerRow:
    record = dict(zip(_COLUMNS, values, strict=True))
    try:
        detail = json.loads(record["detail"])
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"row {record['seq']}: detail is not JSON") from exc
    if not isinstance(detail, dict):
        raise LedgerError(f"row {record['seq']}: detail is not a JSON object")
    record["detail"] = detail
    return LedgerRow(**record)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What :func:`verify_ledger` found. ``first_bad_seq`` names the first row the chain breaks at."""

    ok: bool
    rows: int
    head_hash: str | None
    first_bad_seq: int | None
    reason: str | None


# --- validation -----------------------------------------------------------------------------
def _is_keylike(name: str) -> bool:
    lowered = name.lower()
    if lowered in ("fp", "fingerprint") or lowered.endswith(_FINGERPRINT_SUFFIXES):
        return False
    return any(word in lowered for word in _KEYLIKE_WORDS)


def _check_detail(value: Any, where: str) -> None:
    """Refuse key-like names (at any depth) and anything that is not plain JSON."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            if not isinstance(name, str):
                raise LedgerError(f"{where}: name {name!r} is not a string")
            if _is_keylike(name):
                raise LedgerError(
                    f"{where}: {name!r} looks like key material; record keys by fingerprint "
                    "(key_fp, *_fingerprint), never the key"
                )
            _check_detail(item, f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_detail(item, f"{where}[{index}]")
    else:
        _check_json_scalar(value, where)


def _check_json_scalar(value: Any, where: str) -> None:
    if isinstance(value, bytes | bytearray | memoryview):
        raise LedgerError(f"{where}: bytes are not recorded (only JSON values; keys by fingerprint)")
    if isinstance(value, float) and not math.isfinite(value):
        raise LedgerError(f"{where}: {value!r} is not a finite number")
    if value is not None and not isinstance(value, str | int | float | bool):
        raise LedgerError(f"{where}: {type(value).__name__} is not a JSON value")


def _opt_text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise LedgerError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LedgerError(f"{name} must be an integer, not {type(value).__name__}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise LedgerError(f"{name}={value} does not fit in 64 bits")
    return int(value)


def _opt_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LedgerError(f"{name} must be a number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise LedgerError(f"{name}={value!r} is not a finite number")
    return number


# --- the ledger -----------------------------------------------------------------------------
class Ledger:
    """An open ledger: one SQLite connection, shared across threads behind a lock.

    Open with :meth:`Ledger.open`; use as a context manager or call :meth:`close`.
    """

    def __init__(self, connection: sqlite3.Connection, *, path: Path, run_id: str) -> None:
        self._db = connection
        self._lock = threading.RLock()
        self._closed = False
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
            connection.execute("PRAGMA synchronous=FULL")
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
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise LedgerError(f"ledger {self.path}: append failed: {exc}") from exc
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
        """``(seq, hash)`` of the last row; ``(0, GENESIS_HASH)`` when empty."""
        with self._lock:
            self._check_open()
            last = self._db.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        return (0, GENESIS_HASH) if last is None else (int(last[0]), str(last[1]))

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if not self._closed:
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
def _connect_read_only(path: Path) -> sqlite3.Connection:
    """Open ``path`` with ``mode=ro``: nothing done through this connection can change the file."""
    if not path.is_file():
        raise LedgerError(f"{path}: no such ledger file")
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    try:
        tables = {
            name
            for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        missing = {"schema_version", "events", "state"} - tables
        if missing:
            raise LedgerError(f"{path} is not a gputravel ledger (missing {', '.join(sorted(missing))})")
        versions = [v for (v,) in connection.execute("SELECT version FROM schema_version")]
        if versions != [SCHEMA_VERSION]:
            raise LedgerError(f"{path}: unsupported ledger schema version {versions}")
    except sqlite3.Error as exc:
        connection.close()
        raise LedgerError(f"{path} is not a gputravel ledger: {exc}") from exc
    except BaseException:
        connection.close()
        raise
    return connection


def read_rows(
    path: Path, *, since_seq: int = 0, holder: str | None = None, limit: int | None = None
) -> list[LedgerRow]:
    """Rows of the ledger at ``path`` in seq order, read-only; ``limit`` keeps the most recent ones.

    Raises:
        LedgerError: the file is missing or not a ledger.
    """
    path = Path(path)
    connection = _connect_read_only(path)
    try:
        query = f"{_SELECT} WHERE seq > ?"
        params: list[Any] = [since_seq]
        if holder is not None:
            query += " AND holder = ?"
            params.append(holder)
        query += " ORDER BY seq DESC"
        if limit is not None:
            query += " LIMIT ?"
            params.append(max(limit, 0))
        return [_row_from_db(values) for values in reversed(connection.execute(query, params).fetchall())]
    except sqlite3.Error as exc:
        raise LedgerError(f"{path}: cannot read ledger: {exc}") from exc
    finally:
        connection.close()


def read_state(path: Path) -> dict[str, Any]:
    """The progress state next to the chain (``Ledger.state_items``), read-only.

    Raises:
        LedgerError: the file is missing, not a ledger, or a state value is not JSON.
    """
    path = Path(path)
    connection = _connect_read_only(path)
    try:
        found = connection.execute("SELECT key, value FROM state ORDER BY key").fetchall()
        return {str(key): json.loads(value) for key, value in found}
    except (sqlite3.Error, ValueError) as exc:
        raise LedgerError(f"{path}: cannot read the ledger state: {exc}") from exc
    finally:
        connection.close()


def parse_head(text: str) -> tuple[int, str]:
    """``"SEQ:HASH"`` (as ``gputravel run`` and ``ledger verify`` print a head) to ``(seq, hash)``."""
    seq_text, sep, digest = text.strip().partition(":")
    digest = digest.lower()
    if not sep or not seq_text.isdigit() or int(seq_text) < 1 or len(digest) != 64 or \
            any(c not in "0123456789abcdef" for c in digest):
        raise LedgerError(f"a ledger head is SEQ:HASH (a row number and its 64-hex-digit hash), not {text!r}")
    return int(seq_text), digest


def verify_ledger(path: Path, *, expect_head: tuple[int, str] | None = None,
                  expect_heads: Iterable[tuple[int, str]] = ()) -> VerifyResult:
    """Recompute every row hash and chain link in seq order; never raises, never writes.

    Finds an altered field or hash (``hash mismatch``), a broken link (``prev_hash does not link``), a
    deleted row (``missing``), reordered rows (either), and files that are not ledgers.

    With ``expect_head`` / ``expect_heads`` (``(seq, hash)`` pairs recorded elsewhere: an earlier run's
    report, a holder's witness file) it also finds what the chain alone cannot: rows cut off the end
    (``truncated``) and a chain rewritten from some row on (``differs from the recorded head``). Rows
    appended after those heads are fine.
    """
    heads = sorted({*expect_heads, *([expect_head] if expect_head else [])})
    result, hashes = _verify_chain(Path(path), {seq for seq, _ in heads})
    if not result.ok:
        return result
    for seq, digest in heads:
        if result.rows < seq:
            return VerifyResult(ok=False, rows=result.rows, head_hash=result.head_hash, first_bad_seq=result.rows + 1,
                                reason=f"truncated: the ledger ends at row {result.rows}, the recorded head is row {seq}")
        if hashes.get(seq) != digest:
            return VerifyResult(ok=False, rows=result.rows, head_hash=result.head_hash, first_bad_seq=seq,
                                reason=f"row {seq} differs from the recorded head: the chain was rewritten up to it")
    return result


def witnessed_heads(path: Path) -> list[tuple[int, str]]:
    """The ledger heads in a holder's witness file (JSON lines with ``ledger_head`` = ``"SEQ:HASH"``, as the
    holder agent writes them at each hand-off)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LedgerError(f"{path}: cannot read the witness file: {exc.strerror or exc}") from None
    heads = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            heads.append(parse_head(str(record["ledger_head"])))
        except (ValueError, KeyError, TypeError, LedgerError) as exc:
            raise LedgerError(f"{path}: line {number} is not a witness record ({exc})") from None
    if not heads:
        raise LedgerError(f"{path}: the witness file holds no ledger head")
    return heads


def _verify_chain(path: Path, remember: set[int]) -> tuple[VerifyResult, dict[int, str]]:
    """The chain walk of :func:`verify_ledger`; keeps the hashes of the rows in ``remember``."""
    try:
        connection = _connect_read_only(path)
    except LedgerError as exc:
        return VerifyResult(ok=False, rows=0, head_hash=None, first_bad_seq=None, reason=exc.reason), {}
    except (sqlite3.Error, OSError) as exc:
        return VerifyResult(ok=False, rows=0, head_hash=None, first_bad_seq=None, reason=str(exc)), {}
    rows = 0
    prev = GENESIS_HASH
    head: str | None = None
    remembered: dict[int, str] = {}

    def broken(bad_seq: int, reason: str) -> tuple[VerifyResult, dict[int, str]]:
        return VerifyResult(ok=False, rows=rows, head_hash=head, first_bad_seq=bad_seq, reason=reason), {}

    try:
        connection.execute("BEGIN")  # one read snapshot, even while a writer appends
        for values in connection.execute(f"{_SELECT} ORDER BY seq"):
            record = dict(zip(_COLUMNS, values, strict=True))
            seq = record["seq"]
            expected_seq = rows + 1
            if seq != expected_seq:
                if seq > expected_seq:
                    span = str(expected_seq) if seq == expected_seq + 1 else f"{expected_seq}-{seq - 1}"
                    return broken(expected_seq, f"row {span} missing (chain jumps from {rows} to {seq})")
                return broken(seq, f"row {seq}: out of order after row {rows}")
            try:
                computed = row_hash(str(record["prev_hash"]), record)
            except (TypeError, ValueError) as exc:
                return broken(seq, f"row {seq}: unhashable field ({exc})")
            if computed != record["hash"]:
                return broken(seq, f"row {seq}: hash mismatch")
            if record["prev_hash"] != prev:
                link = "genesis" if seq == 1 else f"row {seq - 1}"
                return broken(seq, f"row {seq}: prev_hash does not link to {link}")
            rows += 1
            prev = head = str(record["hash"])
            if seq in remember:
                remembered[seq] = head
        return VerifyResult(ok=True, rows=rows, head_hash=head, first_bad_seq=None, reason=None), remembered
    except sqlite3.Error as exc:
        return broken(rows + 1, f"unreadable after row {rows}: {exc}")
    finally:
        connection.close()
