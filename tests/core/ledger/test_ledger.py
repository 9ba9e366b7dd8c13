"""The audit ledger: the hash chain proves what ran, and any tampering is found and named."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.errors import LedgerError
from gputravel.core.ledger import (
    GENESIS_HASH,
    Ledger,
    LedgerRow,
    canonical_json,
    parse_head,
    read_rows,
    read_run_id,
    row_hash,
    verify_ledger,
    verify_ledger_select,
)


def _fill(path: Path, count: int = 6) -> list[LedgerRow]:
    with Ledger.open(path, run_id="run-1") as ledger:
        return [
            ledger.append(
                kind="phase",
                phase=("handoff", "provision", "return", "integrity", "train", "scrub")[i % 6],
                holder=f"holder-{i % 2}",
                epoch=i,
                key_fp=f"{i:02x}" * 8,
                nbytes=256 * 1024 * (i + 1),
                duration_s=0.125 * (i + 1),
                detail={"chunks": i, "note": f"visit {i}"},
                state={"visit": i},
            )
            for i in range(count)
        ]


def _execute(path: Path, sql: str, params: tuple[Any, ...] = ()) -> None:
    db = sqlite3.connect(path)
    try:
        db.execute(sql, params)
        db.commit()
    finally:
        db.close()


def _raw(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    path = tmp_path / "audit.sqlite"
    _fill(path)
    return path


# --- the chain ------------------------------------------------------------------------------
def test_appended_chain_verifies_and_reports_its_head(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    appended = _fill(path)

    result = verify_ledger(path)

    assert result.ok and result.reason is None and result.first_bad_seq is None
    assert result.rows == 6
    assert result.head_hash == appended[-1].hash
    assert [row.seq for row in appended] == [1, 2, 3, 4, 5, 6]
    assert appended[0].prev_hash == GENESIS_HASH
    assert all(later.prev_hash == earlier.hash for earlier, later in zip(appended, appended[1:], strict=False))


def test_row_hash_is_sha256_of_prev_hash_and_canonical_fields(ledger_path: Path) -> None:
    with Ledger.open(ledger_path) as ledger:
        first = next(ledger.rows())
    fields = first.to_dict() | {"detail": canonical_json(first.detail)}
    expected = hashlib.sha256(
        GENESIS_HASH.encode() + canonical_json({k: fields[k] for k in (
            "seq", "ts", "run_id", "kind", "phase", "holder", "epoch", "key_fp", "nbytes", "duration_s",
            "outcome", "detail")}).encode()
    ).hexdigest()
    assert first.hash == expected == row_hash(GENESIS_HASH, fields)


def test_detail_is_stored_as_canonical_json_whatever_the_key_order(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        row = ledger.append(kind="k", detail={"b": 1, "a": [1.5, "é"], "c": {"z": None, "y": True}})
    stored = _raw(tmp_path / "a.sqlite", "SELECT detail FROM events")[0][0]
    assert stored == '{"a":[1.5,"é"],"b":1,"c":{"y":true,"z":null}}'
    assert row.detail == {"a": [1.5, "é"], "b": 1, "c": {"y": True, "z": None}}
    assert verify_ledger(tmp_path / "a.sqlite").ok


def test_awkward_floats_round_trip_through_sqlite_and_still_verify(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with Ledger.open(path) as ledger:
        ledger.append(kind="k", ts=0.1 + 0.2, duration_s=1e-300, detail={"x": 2.0**0.5})
        ledger.append(kind="k", ts=1_700_000_000.123456789, duration_s=5, nbytes=2**63 - 1)
        rows = list(ledger.rows())
    assert rows[0].ts == 0.1 + 0.2 and rows[1].duration_s == 5.0
    assert verify_ledger(path).ok


def test_reopening_continues_the_same_chain_under_a_new_run_id(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, run_id="run-2") as ledger:
        before = ledger.head()
        row = ledger.append(kind="run-started")
    assert (row.seq, row.prev_hash) == (before[0] + 1, before[1])
    assert row.run_id == "run-2"
    assert verify_ledger(ledger_path).rows == 7


def test_appends_from_many_threads_form_one_unbroken_chain(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with Ledger.open(path) as ledger:

        def worker(n: int) -> None:
            for i in range(20):
                ledger.append(kind="tick", holder=f"t{n}", epoch=i, state={f"t{n}": i})

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert ledger.head()[0] == 80
        assert ledger.state_items() == {f"t{n}": 19 for n in range(4)}
    assert verify_ledger(path).ok


def test_rows_since_seq_and_to_dict_return_what_was_appended(ledger_path: Path) -> None:
    with Ledger.open(ledger_path) as ledger:
        rows = list(ledger.rows(since_seq=4))
    assert [row.seq for row in rows] == [5, 6]
    as_dict = rows[0].to_dict()
    assert as_dict["holder"] == "holder-0" and as_dict["detail"] == {"chunks": 4, "note": "visit 4"}
    assert json.loads(json.dumps(as_dict)) == as_dict


def test_verify_ledger_select_keeps_the_rows_it_selects_in_the_same_walk_and_none_of_a_broken_chain(
        ledger_path: Path) -> None:
    """``holder verify``'s one pass (issue 30): the chain checked and the selected rows parsed together."""
    seen: list[int] = []

    def select(record: dict[str, Any]) -> bool:
        seen.append(record["seq"])
        assert isinstance(record["detail"], str)  # still the stored text: only kept rows are parsed
        return bool(record["holder"] == "holder-1")

    result, kept = verify_ledger_select(ledger_path, select=select)
    assert result.ok and result.rows == 6 and seen == [1, 2, 3, 4, 5, 6]
    assert kept == [row for row in read_rows(ledger_path) if row.holder == "holder-1"] and len(kept) == 3
    assert read_run_id(ledger_path) == "run-1"
    _execute(ledger_path, "UPDATE events SET nbytes = nbytes + 1 WHERE seq = 4")
    result, kept = verify_ledger_select(ledger_path, select=lambda record: True)
    assert (result.ok, result.first_bad_seq, kept) == (False, 4, [])


def test_ledger_uses_wal_journal_committed_at_once_and_flushed_where_relied_on(
        ledger_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every append commits (NORMAL in WAL mode); the WAL is fsynced before a head is read, with a row that carries
    progress state and at close, once for every row since the last flush (a spy counts the real fsyncs)."""
    assert _raw(ledger_path, "PRAGMA journal_mode")[0][0] == "wal"
    synced: list[str] = []
    real_fsync = os.fsync

    def spy_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    with Ledger.open(ledger_path) as ledger:
        assert ledger._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: flushed by Ledger.flush
        assert ledger._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        for i in range(3):
            ledger.append(kind="phase", phase="TRAIN", epoch=i)
        assert synced == []  # not yet fsynced
        with Ledger.open(ledger_path) as other:  # committed: another connection reads them
            assert len(list(other.rows())) == 9  # the fixture's six and these three
        assert synced == []  # a connection that appended nothing flushes nothing at close
        seq, _ = ledger.head()
        assert seq == 9 and synced == [str(ledger_path) + "-wal"]  # one fsync for the three rows
        ledger.head()
        ledger.flush()
        assert len(synced) == 1  # nothing new since: nothing to flush
        ledger.append(kind="visit-completed", state={"visits_done": [0]})
        assert len(synced) == 2  # progress is on disk before append returns
        ledger.append(kind="phase", phase="SCRUB")
    assert len(synced) == 3  # close flushed the last row
    assert _raw(ledger_path, "SELECT version FROM schema_version") == [(1,)]


def test_a_flush_the_disk_refuses_is_a_named_error_and_the_next_flush_tries_again(
        ledger_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that fails with no space is DiskFullError, any other failure StorageError, both naming the ledger;
    the rows stay committed (another connection reads them) and stay owed: the next flush fsyncs them. The
    failing fsync is a fake (``refusing_fsync``) that isolates the flush; the retry's fsync is the real one."""
    import errno

    from gputravel.core.errors import DiskFullError, StorageError

    real_fsync = os.fsync
    refusals = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "Input/output error")]
    synced: list[int] = []

    def refusing_fsync(fd: int) -> None:
        if refusals:
            raise refusals.pop(0)
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", refusing_fsync)
    with Ledger.open(ledger_path) as ledger:
        ledger.append(kind="phase", phase="TRAIN", epoch=1)
        with pytest.raises(DiskFullError, match="no space left") as full:
            ledger.flush()
        assert str(ledger_path) in str(full.value) and "--resume" in str(full.value)
        with pytest.raises(StorageError, match="write failed") as failed:
            ledger.head()  # a head is read only after a flush: refused too
        assert not isinstance(failed.value, DiskFullError) and str(ledger_path) in str(failed.value)
        with Ledger.open(ledger_path) as other:  # committed all the same
            assert [r.phase for r in other.rows()][-1] == "TRAIN"
        assert synced == []
        assert ledger.head()[0] == 7 and len(synced) == 1  # owed still: this flush fsynced the row
        ledger.flush()
        assert len(synced) == 1  # and nothing is owed after it


# --- tampering ------------------------------------------------------------------------------
def test_changing_one_byte_of_nbytes_is_detected_at_that_row(ledger_path: Path) -> None:
    _execute(ledger_path, "UPDATE events SET nbytes = nbytes + 1 WHERE seq = 4")

    result = verify_ledger(ledger_path)

    assert not result.ok
    assert result.first_bad_seq == 4
    assert result.reason == "row 4: hash mismatch"
    assert result.rows == 3


def test_changing_one_byte_of_the_detail_text_is_detected_at_that_row(ledger_path: Path) -> None:
    (text,) = _raw(ledger_path, "SELECT detail FROM events WHERE seq = 2")[0]
    _execute(ledger_path, "UPDATE events SET detail = ? WHERE seq = 2", (text.replace("visit 1", "visit 7"),))

    result = verify_ledger(ledger_path)

    assert (result.ok, result.first_bad_seq) == (False, 2)
    assert "row 2" in (result.reason or "")


def test_a_whitespace_only_change_to_detail_is_still_detected(ledger_path: Path) -> None:
    (text,) = _raw(ledger_path, "SELECT detail FROM events WHERE seq = 5")[0]
    _execute(ledger_path, "UPDATE events SET detail = ? WHERE seq = 5", (text.replace(":", ": ", 1),))
    assert verify_ledger(ledger_path).first_bad_seq == 5


def test_a_rehashed_forged_row_breaks_the_link_of_the_next_row(ledger_path: Path) -> None:
    rows = _raw(ledger_path, "SELECT seq, ts, run_id, kind, phase, holder, epoch, key_fp, nbytes, duration_s, "
                "outcome, detail, prev_hash FROM events WHERE seq = 3")[0]
    names = ("seq", "ts", "run_id", "kind", "phase", "holder", "epoch", "key_fp", "nbytes", "duration_s",
             "outcome", "detail", "prev_hash")
    forged = dict(zip(names, rows, strict=True)) | {"outcome": "forged"}
    _execute(ledger_path, "UPDATE events SET outcome = 'forged', hash = ? WHERE seq = 3",
             (row_hash(forged["prev_hash"], forged),))

    result = verify_ledger(ledger_path)

    assert (result.ok, result.first_bad_seq) == (False, 4)
    assert result.reason == "row 4: prev_hash does not link to row 3"


def test_deleting_a_middle_row_is_detected(ledger_path: Path) -> None:
    _execute(ledger_path, "DELETE FROM events WHERE seq = 3")

    result = verify_ledger(ledger_path)

    assert not result.ok
    assert result.first_bad_seq == 3
    assert "row 3 missing" in (result.reason or "")


def test_swapping_two_rows_contents_is_detected(ledger_path: Path) -> None:
    cols = "ts, run_id, kind, phase, holder, epoch, key_fp, nbytes, duration_s, outcome, detail, prev_hash, hash"
    two = _raw(ledger_path, f"SELECT {cols} FROM events WHERE seq = 2")[0]
    five = _raw(ledger_path, f"SELECT {cols} FROM events WHERE seq = 5")[0]
    assignments = ", ".join(f"{c.strip()} = ?" for c in cols.split(","))
    _execute(ledger_path, f"UPDATE events SET {assignments} WHERE seq = 2", (*five,))
    _execute(ledger_path, f"UPDATE events SET {assignments} WHERE seq = 5", (*two,))

    result = verify_ledger(ledger_path)

    assert (result.ok, result.first_bad_seq) == (False, 2)


def test_renumbering_rows_into_another_order_is_detected(ledger_path: Path) -> None:
    _execute(ledger_path, "UPDATE events SET seq = 100 WHERE seq = 2")
    _execute(ledger_path, "UPDATE events SET seq = 2 WHERE seq = 3")
    _execute(ledger_path, "UPDATE events SET seq = 3 WHERE seq = 100")

    result = verify_ledger(ledger_path)

    assert (result.ok, result.first_bad_seq) == (False, 2)


def test_a_non_sqlite_file_is_reported_not_ok_without_raising(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database\n" * 200)

    result = verify_ledger(junk)

    assert (result.ok, result.rows, result.head_hash) == (False, 0, None)
    assert "not a gputravel ledger" in (result.reason or "")


def test_an_sqlite_file_without_ledger_tables_is_reported_not_ok(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    _execute(other, "CREATE TABLE t (x)")
    result = verify_ledger(other)
    assert not result.ok and "missing" in (result.reason or "")


def test_a_missing_file_is_reported_not_ok_and_not_created(tmp_path: Path) -> None:
    result = verify_ledger(tmp_path / "absent.sqlite")
    assert not result.ok and "no such" in (result.reason or "")
    assert not (tmp_path / "absent.sqlite").exists()


def test_opening_a_non_sqlite_file_for_writing_raises_ledger_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"garbage" * 1000)
    with pytest.raises(LedgerError):
        Ledger.open(junk)
    assert junk.read_bytes() == b"garbage" * 1000


def test_verify_never_changes_the_ledger_file(ledger_path: Path) -> None:
    before = (ledger_path.read_bytes(), ledger_path.stat().st_mtime_ns)
    _execute(ledger_path, "SELECT 1")  # nothing; the tampered case must not be "repaired" either

    assert verify_ledger(ledger_path).ok
    assert (ledger_path.read_bytes(), ledger_path.stat().st_mtime_ns) == before

    _execute(ledger_path, "UPDATE events SET epoch = 99 WHERE seq = 6")
    tampered = (ledger_path.read_bytes(), ledger_path.stat().st_mtime_ns)
    assert not verify_ledger(ledger_path).ok
    assert (ledger_path.read_bytes(), ledger_path.stat().st_mtime_ns) == tampered


def test_verify_reads_a_consistent_snapshot_while_the_ledger_is_open(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with Ledger.open(path) as ledger:
        ledger.append(kind="a")
        assert verify_ledger(path).rows == 1
        ledger.append(kind="b")
        assert verify_ledger(path).rows == 2


# --- state atomicity ------------------------------------------------------------------------
def test_state_is_committed_with_its_event(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        ledger.append(kind="visit", state={"visit": 1, "holder": "h1"})
        ledger.append(kind="visit", state={"visit": 2})
        assert ledger.get_state("visit") == 2
        assert ledger.get_state("absent", default="d") == "d"
        assert ledger.state_items() == {"holder": "h1", "visit": 2}


def test_a_state_value_that_is_not_json_lands_neither_event_nor_state(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with Ledger.open(path) as ledger:
        ledger.append(kind="visit", state={"visit": 1})
        with pytest.raises(LedgerError, match="not JSON"):
            ledger.append(kind="visit", state={"visit": 2, "bad": object()})
        assert ledger.head()[0] == 1
        assert ledger.state_items() == {"visit": 1}
        assert ledger.append(kind="after").seq == 2  # the lock and the connection are usable again
    assert verify_ledger(path).ok


def test_a_failing_state_write_inside_the_transaction_rolls_back_its_event(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with Ledger.open(path) as ledger:
        ledger.append(kind="visit", state={"visit": 1})
    # The database itself refuses the second state item, after the event row was inserted.
    _execute(path, "CREATE TRIGGER refuse BEFORE INSERT ON state WHEN NEW.key = 'doomed' "
                   "BEGIN SELECT RAISE(ABORT, 'refused by test'); END")
    with Ledger.open(path) as ledger:
        with pytest.raises(LedgerError, match="refused by test"):
            ledger.append(kind="visit", state={"visit": 2, "doomed": True})
        assert ledger.head()[0] == 1
        assert ledger.state_items() == {"visit": 1}
    assert verify_ledger(path).rows == 1


# --- no key material ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "detail",
    [
        {"key": "00" * 32},
        {"AES_KEY": "x"},
        {"sessionKey": "x"},
        {"client_secret": "x"},
        {"master_seed": "x"},
        {"Private": "x"},
        {"nested": {"provisioning_key": "x"}},
        {"list": [{"secret": 1}]},
    ],
)
def test_key_like_detail_names_are_refused_and_nothing_is_written(tmp_path: Path, detail: dict[str, Any]) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        with pytest.raises(LedgerError, match="key material"):
            ledger.append(kind="visit", detail=detail)
        assert ledger.head() == (0, GENESIS_HASH)


def test_fingerprint_names_are_allowed(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        row = ledger.append(
            kind="key-rotated", key_fp="ab" * 8,
            detail={"key_fp": "ab" * 8, "provisioning_key_fingerprint": "cd" * 8, "old_key_fp": "ef" * 8},
        )
    assert row.detail["key_fp"] == "ab" * 8


@pytest.mark.parametrize("value", [b"\x00" * 32, bytearray(b"k"), memoryview(b"k"), {1, 2}, float("nan")])
def test_values_that_are_not_plain_json_are_refused(tmp_path: Path, value: Any) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        with pytest.raises(LedgerError):
            ledger.append(kind="visit", detail={"blob": value})
        with pytest.raises(LedgerError):
            ledger.append(kind="visit", state={"blob": value})
        assert ledger.head()[0] == 0


@pytest.mark.parametrize(
    "fields", [{"epoch": True}, {"epoch": "3"}, {"nbytes": 2**64}, {"duration_s": float("inf")}, {"holder": 7}]
)
def test_mistyped_fields_are_refused(tmp_path: Path, fields: dict[str, Any]) -> None:
    with Ledger.open(tmp_path / "a.sqlite") as ledger:
        with pytest.raises(LedgerError):
            ledger.append(kind="visit", **fields)


def test_a_closed_ledger_refuses_appends(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "a.sqlite")
    ledger.close()
    ledger.close()
    with pytest.raises(LedgerError, match="closed"):
        ledger.append(kind="late")


# --- CLI ------------------------------------------------------------------------------------
runner = CliRunner()


def test_cli_verify_exits_0_and_prints_rows_and_head_when_intact(ledger_path: Path) -> None:
    head = verify_ledger(ledger_path).head_hash

    result = runner.invoke(app, ["ledger", "verify", str(ledger_path)])

    assert result.exit_code == 0, result.output
    assert "6 rows" in result.output and str(head) in result.output.replace("\n", "")


def test_cli_verify_exits_8_naming_the_tampered_row(ledger_path: Path) -> None:
    _execute(ledger_path, "UPDATE events SET nbytes = 1 WHERE seq = 5")

    result = runner.invoke(app, ["ledger", "verify", str(ledger_path)])

    assert result.exit_code == LedgerError.exit_code == 8
    assert "row 5: hash mismatch" in result.output


def test_cli_verify_json_reports_the_result(ledger_path: Path) -> None:
    _execute(ledger_path, "DELETE FROM events WHERE seq = 2")

    result = runner.invoke(app, ["ledger", "verify", str(ledger_path), "--json"])

    assert result.exit_code == 8
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["first_bad_seq"] == 2


def test_cli_verify_of_a_non_ledger_exits_8(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_text("nope")
    result = runner.invoke(app, ["ledger", "verify", str(junk)])
    assert result.exit_code == 8 and "not a gputravel ledger" in result.output


def test_cli_show_lists_the_rows_of_one_holder(ledger_path: Path) -> None:
    result = runner.invoke(app, ["ledger", "show", str(ledger_path), "--holder", "holder-1"], env={"COLUMNS": "200"})

    assert result.exit_code == 0, result.output
    assert "holder-1" in result.output and "holder-0" not in result.output
    assert "256.0 KiB" not in result.output  # seq 1 belongs to holder-0
    assert "512.0 KiB" in result.output


def test_cli_show_json_limit_keeps_the_most_recent_rows(ledger_path: Path) -> None:
    result = runner.invoke(app, ["ledger", "show", str(ledger_path), "--json", "--limit", "2"])

    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["seq"] for row in rows] == [5, 6]
    assert rows[1]["key_fp"] == "05" * 8


def test_cli_show_of_a_missing_ledger_is_bad_input_naming_the_path(tmp_path: Path) -> None:
    # issue 35: a typo is not a tamper verdict (exit 2, the path named), a broken chain stays exit 8
    result = runner.invoke(app, ["ledger", "show", str(tmp_path / "absent.sqlite")])
    assert result.exit_code == 2 and str(tmp_path / "absent.sqlite") in result.output


# --- a head recorded elsewhere: truncation and rewrites ------------------------------------------
def test_cut_off_tail_passes_the_chain_but_fails_against_the_recorded_head(ledger_path: Path) -> None:
    head = verify_ledger(ledger_path)
    _execute(ledger_path, "DELETE FROM events WHERE seq > 4")

    assert verify_ledger(ledger_path).ok  # the chain alone cannot see a cut tail
    result = verify_ledger(ledger_path, expect_head=(6, head.head_hash or ""))

    assert (result.ok, result.rows, result.first_bad_seq) == (False, 4, 5)
    assert result.reason == "truncated: the ledger ends at row 4, the recorded head is row 6"


def test_tail_rewritten_with_fresh_rows_fails_against_the_recorded_head(ledger_path: Path) -> None:
    head = verify_ledger(ledger_path)
    _execute(ledger_path, "DELETE FROM events WHERE seq > 4")
    with Ledger.open(ledger_path, run_id="run-1") as ledger:
        for i in (4, 5):
            ledger.append(kind="phase", phase="train", holder=f"holder-{i % 2}", detail={"note": "forged"})

    assert verify_ledger(ledger_path).ok and verify_ledger(ledger_path).rows == 6
    result = verify_ledger(ledger_path, expect_head=(6, head.head_hash or ""))

    assert (result.ok, result.first_bad_seq) == (False, 6)
    assert result.reason == "row 6 differs from the recorded head: the chain was rewritten up to it"


def test_rows_appended_after_the_recorded_head_still_verify(ledger_path: Path) -> None:
    head = verify_ledger(ledger_path)
    with Ledger.open(ledger_path, run_id="run-2") as ledger:
        ledger.append(kind="phase", phase="train", holder="holder-0", detail={"note": "later run"})

    result = verify_ledger(ledger_path, expect_head=(6, head.head_hash or ""))

    assert (result.ok, result.rows) == (True, 7)


@pytest.mark.parametrize("text", ["", "6", "6:", ":" + "a" * 64, "0:" + "a" * 64, "x:" + "a" * 64,
                                  "6:" + "a" * 63, "6:" + "g" * 64])
def test_malformed_heads_are_ledger_errors(text: str) -> None:
    with pytest.raises(LedgerError, match="SEQ:HASH"):
        parse_head(text)


def test_cli_verify_head_finds_a_cut_tail_and_refuses_a_malformed_head(ledger_path: Path) -> None:
    intact = runner.invoke(app, ["ledger", "verify", str(ledger_path)], env={"COLUMNS": "200"})
    assert intact.exit_code == 0, intact.output
    head = next(word for word in intact.output.split() if word.startswith("6:"))
    assert parse_head(head) == (6, verify_ledger(ledger_path).head_hash)
    assert runner.invoke(app, ["ledger", "verify", str(ledger_path), "--head", head]).exit_code == 0

    _execute(ledger_path, "DELETE FROM events WHERE seq = 6")
    cut = runner.invoke(app, ["ledger", "verify", str(ledger_path), "--head", head], env={"COLUMNS": "200"})
    assert cut.exit_code == 8 and "truncated" in cut.output

    malformed = runner.invoke(app, ["ledger", "verify", str(ledger_path), "--head", "six"])
    assert malformed.exit_code == 2 and "SEQ:HASH" in malformed.output


# --- property: any append sequence verifies, any single-field mutation is caught ------------
_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8).filter(
    lambda name: not any(word in name.lower() for word in ("key", "secret", "master", "private"))
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_names, children, max_size=3),
    max_leaves=8,
)
_append = st.fixed_dictionaries(
    {"kind": st.sampled_from(["phase", "visit", "key-rotated"])},
    optional={
        "phase": st.sampled_from(["handoff", "provision", "train", "scrub"]),
        "holder": st.text(min_size=1, max_size=6),
        "epoch": st.integers(0, 2**40),
        "key_fp": st.text(alphabet="0123456789abcdef", min_size=16, max_size=16),
        "nbytes": st.integers(0, 2**40),
        "duration_s": st.floats(0, 1e6, allow_nan=False),
        "outcome": st.sampled_from(["ok", "failed", "aborted"]),
        "detail": st.dictionaries(_names, _json, max_size=3),
        "ts": st.floats(0, 4e9, allow_nan=False),
    },
)
_FIELDS = ("seq", "ts", "run_id", "kind", "phase", "holder", "epoch", "key_fp", "nbytes", "duration_s",
           "outcome", "detail", "prev_hash", "hash")


def _mutated(value: Any, field: str, pick: int) -> Any:
    if value is None:
        return {"epoch": 0, "nbytes": 0, "duration_s": 0.0, "ts": 0.0}.get(field, "x")
    if isinstance(value, bool | int):
        return value + 1 + pick % 3
    if isinstance(value, float):
        return value + 1.0 if value < 1e15 else value * 2
    text = str(value)
    if not text:
        return "x"
    index = pick % len(text)
    return text[:index] + ("a" if text[index] != "a" else "b") + text[index + 1:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    appends=st.lists(_append, min_size=1, max_size=8),
    target=st.integers(0, 7),
    field=st.sampled_from(_FIELDS),
    pick=st.integers(0, 10_000),
)
def test_any_append_sequence_verifies_and_any_single_field_mutation_is_caught(
    appends: list[dict[str, Any]], target: int, field: str, pick: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.sqlite"
        with Ledger.open(path, run_id="prop") as ledger:
            for fields in appends:
                ledger.append(**fields)
        intact = verify_ledger(path)
        assert intact.ok and intact.rows == len(appends)

        seq = target % len(appends) + 1
        (value,) = _raw(path, f"SELECT {field} FROM events WHERE seq = ?", (seq,))[0]
        new = _mutated(value, field, pick)
        if field == "seq":
            new = len(appends) + 1 + pick  # renumber past the end: row `seq` is missing from the chain
        _execute(path, f"UPDATE events SET {field} = ? WHERE seq = ?", (new, seq))

        result = verify_ledger(path)
        assert not result.ok
        assert result.first_bad_seq == seq, (field, value, new, result)
