"""The ledger's rows: the schema's fields, canonical JSON, the hash chain's step, the checks on what a row may hold."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gputravel.core.errors import LedgerError

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
    return _CANONICAL.encode(obj)


#: ``json.dumps`` with these options builds this same encoder on every call; one kept (it holds no state
#: between calls) spells every row identically and saves a third of the hashing time of a long ledger.
_CANONICAL: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


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
