"""Reading a ledger read-only: rows, the progress state, and verifying the chain (against a recorded head or a holder's witness)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gputravel.core.errors import LedgerError
from gputravel.core.ledger.rows import (
    _COLUMNS,
    _SELECT,
    GENESIS_HASH,
    SCHEMA_VERSION,
    LedgerRow,
    VerifyResult,
    _row_from_db,
    row_hash,
)


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


def read_run_id(path: Path) -> str | None:
    """The run id of the ledger's first row (None: no rows), read-only and without reading the rest.

    Raises:
        LedgerError: the file is missing or not a ledger.
    """
    path = Path(path)
    connection = _connect_read_only(path)
    try:
        found = connection.execute("SELECT run_id FROM events ORDER BY seq LIMIT 1").fetchone()
        return None if found is None or found[0] is None else str(found[0])
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
    return verify_ledger_select(path, expect_head=expect_head, expect_heads=expect_heads)[0]


#: a verified row as ``verify_ledger_select`` hands it to ``select``: every column, ``detail`` still JSON text
RawRow = dict[str, Any]


def verify_ledger_select(path: Path, *, expect_head: tuple[int, str] | None = None,
                         expect_heads: Iterable[tuple[int, str]] = (),
                         select: Callable[[RawRow], bool] | None = None) -> tuple[VerifyResult, list[LedgerRow]]:
    """:func:`verify_ledger` and, in the same pass over the same read snapshot, the rows ``select`` keeps
    (called with each row once its hash and link are verified, in seq order; only the rows it keeps have their
    ``detail`` parsed). One walk instead of a walk and a read: ``holder verify`` of a long ledger reads each
    row once. The rows are returned only when the result is ok (else ``[]``)."""
    heads = sorted({*expect_heads, *([expect_head] if expect_head else [])})
    result, hashes, kept = _verify_chain(Path(path), {seq for seq, _ in heads}, select)
    if not result.ok:
        return result, []
    return check_heads(result, hashes, heads), kept


def check_heads(result: VerifyResult, hashes: Mapping[int, str], heads: Iterable[tuple[int, str]]) -> VerifyResult:
    """An intact chain's ``result`` against recorded heads (``(seq, hash)``), given the chain's hashes at those
    rows (``hashes``): ``truncated`` or ``differs from the recorded head`` for the first one that fails."""
    for seq, digest in sorted(heads):
        if result.rows < seq:
            return VerifyResult(ok=False, rows=result.rows, head_hash=result.head_hash, first_bad_seq=result.rows + 1,
                                reason=f"truncated: the ledger ends at row {result.rows}, the recorded head is row {seq}")
        if hashes.get(seq) != digest:
            return VerifyResult(ok=False, rows=result.rows, head_hash=result.head_hash, first_bad_seq=seq,
                                reason=f"row {seq} differs from the recorded head: the chain was rewritten up to it")
    return result


def witnessed_heads(path: Path, *, run_id: str | None = None) -> list[tuple[int, str]]:
    """The ledger heads in a holder's witness file (JSON lines with ``ledger_head`` = ``"SEQ:HASH"``, as the
    holder agent writes them at each hand-off). With ``run_id``, only that run's: a line that names another run
    (``"run"``) is another ledger's head, never this one's (issue 30: a holder's second run made the first look
    rewritten); lines without a run (older agents) are kept."""
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
            if run_id is not None and record.get("run") not in (None, run_id):
                continue
            heads.append(parse_head(str(record["ledger_head"])))
        except (ValueError, KeyError, TypeError, LedgerError) as exc:
            raise LedgerError(f"{path}: line {number} is not a witness record ({exc})") from None
    if not heads:
        raise LedgerError(f"{path}: the witness file holds no ledger head" + (f" of run {run_id}" if run_id else ""))
    return heads


_Walk = tuple[VerifyResult, dict[int, str], list[LedgerRow]]


def _verify_chain(path: Path, remember: set[int], select: Callable[[RawRow], bool] | None = None) -> _Walk:
    """The chain walk of :func:`verify_ledger`; keeps the hashes of the rows in ``remember``, and the rows
    ``select`` keeps (parsed)."""
    try:
        connection = _connect_read_only(path)
    except LedgerError as exc:
        return VerifyResult(ok=False, rows=0, head_hash=None, first_bad_seq=None, reason=exc.reason), {}, []
    except (sqlite3.Error, OSError) as exc:
        return VerifyResult(ok=False, rows=0, head_hash=None, first_bad_seq=None, reason=str(exc)), {}, []
    rows = 0
    prev = GENESIS_HASH
    head: str | None = None
    remembered: dict[int, str] = {}
    kept: list[LedgerRow] = []

    def broken(bad_seq: int, reason: str) -> _Walk:
        return VerifyResult(ok=False, rows=rows, head_hash=head, first_bad_seq=bad_seq, reason=reason), {}, []

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
            if select is not None and select(record):
                try:
                    kept.append(_row_from_db(values))
                except LedgerError as exc:
                    return broken(seq, exc.reason)
        return VerifyResult(ok=True, rows=rows, head_hash=head, first_bad_seq=None, reason=None), remembered, kept
    except sqlite3.Error as exc:
        return broken(rows + 1, f"unreadable after row {rows}: {exc}")
    finally:
        connection.close()
