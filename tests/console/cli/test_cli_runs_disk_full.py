"""A run a full disk stopped, as ``gputravel runs`` tells it (operator walk, session 15: ``runs ls`` said ``died``,
``runs show`` "the run's process is gone and it wrote no final event", though the run ended with DiskFullError,
exit 12: ``status.json``, the recording's ``RunFailed`` and the ledger's last row all needed the full disk).

Now the run keeps room for its last ``status.json`` (``core/runfolder/status.py``), so it reads ``failed: disk
full``; a folder whose disk is full and that holds no final word (a run from before, or one whose disk filled
before it could keep that room) reads ``unknown``, naming the full disk, not ``died``. Each disk is a real tmpfs
(the tests skip where this process may not mount one)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import fill, small_disk
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.console.cli.run_end import RunEnding
from gputravel.core import events as ev
from gputravel.core.runfolder import RESERVE_BYTES, RunFolder, read_status, reserve_status, write_status

DISK_FULL = ("DiskFullError: recording /x/recording.db: no space left (database or disk is full); what was "
             "committed is kept: free space, then `gputravel run --resume` continues")


def _runs(*args: str) -> Any:
    result = CliRunner().invoke(app, ["runs", *args])
    assert result.exit_code == 0, result.output
    return result


def _new_run(path: Path) -> None:
    """What a run leaves before its end: its settings and a ledger file (any content: the status is read)."""
    (path / "settings.json").write_text(json.dumps({"holders": 2, "rounds": 1, "model": "tiny"}))
    (path / "ledger.db").write_bytes(b"")


def test_a_status_the_full_disk_refuses_is_written_in_the_room_kept_for_it(tmp_path: Path) -> None:
    with small_disk(tmp_path / "run", 1 << 20) as run:
        _new_run(run)
        assert reserve_status(run) and RunFolder(run).status_reserve.stat().st_size == RESERVE_BYTES
        fill(run)  # until the disk refuses
        ending = RunEnding(run)
        ending(ev.RunStarted(1.0, "r1", {}, ("alice", "bob"), 2))
        ending(ev.RunFailed(2.0, "r1", DISK_FULL, "disk-full"))
        assert read_status(run)["status"] == "failed" and read_status(run)["code"] == "disk-full"
        assert not RunFolder(run).status_reserve.exists()  # given back, for the status


def test_without_that_room_the_full_disk_refuses_the_status(tmp_path: Path) -> None:
    """Why the room is kept: on the same full disk, no reserve, no status.json."""
    with small_disk(tmp_path / "run", 1 << 20) as run:
        _new_run(run)
        fill(run)
        write_status(run, "failed", run_id="r1", error=DISK_FULL, code="disk-full")
        assert read_status(run) == {}


def test_a_final_status_gives_the_room_back_and_a_pause_keeps_it(tmp_path: Path) -> None:
    _new_run(tmp_path)
    assert reserve_status(tmp_path)
    write_status(tmp_path, "paused", run_id="r1")
    assert RunFolder(tmp_path).status_reserve.exists()
    write_status(tmp_path, "completed", run_id="r1")
    assert not RunFolder(tmp_path).status_reserve.exists() and read_status(tmp_path)["status"] == "completed"


def test_a_run_the_full_disk_stopped_reads_failed_disk_full_in_ls_and_show(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "run-full"
    run.mkdir(parents=True)
    _new_run(run)
    write_status(run, "failed", run_id="r1", error=DISK_FULL, code="disk-full")
    listed = _runs("ls", "--runs-dir", str(tmp_path / "runs"))
    assert "failed: disk full" in listed.stdout and "died" not in listed.stdout
    shown = _runs("show", "run-full", "--runs-dir", str(tmp_path / "runs"))
    assert shown.stdout.splitlines()[0].startswith("run-full failed: disk full"), shown.stdout
    assert "no space left" in shown.stdout
    doc = json.loads(_runs("show", "run-full", "--runs-dir", str(tmp_path / "runs"), "--json").stdout)
    assert (doc["status"], doc["code"]) == ("failed", "disk-full")


def test_a_folder_on_a_full_disk_with_no_final_word_is_unknown_naming_the_disk(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    with small_disk(runs / "run-old", 1 << 20) as run:
        _new_run(run)
        fill(run)
        listed = _runs("ls", "--runs-dir", str(runs))
        assert " unknown " in listed.stdout and "died" not in listed.stdout, listed.stdout
        doc = json.loads(_runs("show", "run-old", "--runs-dir", str(runs), "--json").stdout)
        assert doc["status"] == "unknown" and "its disk is full" in doc["error"]
        assert f"gputravel run --resume --out {run}" in doc["error"]
        os.unlink(run / ".filler")  # space back: nothing says the disk stopped it, so it died, as before
        assert json.loads(_runs("show", "run-old", "--runs-dir", str(runs), "--json").stdout)["status"] == "died"


@pytest.mark.parametrize("status", ["completed", "cancelled"])
def test_other_endings_show_no_cause(tmp_path: Path, status: str) -> None:
    run = tmp_path / "runs" / "run-a"
    run.mkdir(parents=True)
    _new_run(run)
    write_status(run, status, run_id="r1", code="cancelled" if status == "cancelled" else None)
    line = _runs("show", "run-a", "--runs-dir", str(tmp_path / "runs")).stdout.splitlines()[0]
    assert line.startswith(f"run-a {status}  run"), line


def test_runs_ls_at_80_columns_keeps_each_run_on_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Operator walk (session 16): at 80 columns a row of a run started with ``--out /tmp/c16/disk/r1`` and
    ``failed: disk full`` ran to 87 columns, and the terminal put its pid alone on the next line. Narrow, the
    start loses its year and seconds; wide (and to a pipe, 200) it is whole."""
    runs = tmp_path / "runs"
    for name in ("run-20261129-140435", "run-20261129-140959"):
        (runs / name).mkdir(parents=True)
        _new_run(runs / name)
        write_status(runs / name, "failed", run_id="r1", error=DISK_FULL, code="disk-full")
    monkeypatch.setenv("COLUMNS", "80")
    lines = _runs("ls", "--runs-dir", str(runs)).stdout.splitlines()
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
    assert all(line.rstrip().endswith(" -") and "failed: disk full" in line for line in lines[1:]), lines
    monkeypatch.setenv("COLUMNS", "160")
    wide = _runs("ls", "--runs-dir", str(runs)).stdout.splitlines()
    assert all(len(line.split()) >= 8 and ":" in line.split()[-2] for line in wide[1:]), wide  # 14:04:35


def test_a_run_its_disk_stopped_names_its_own_folder_in_the_resume_hint(tmp_path: Path) -> None:
    """Operator walk (session 16, left then, mended): a DiskFullError said ``gputravel run --resume``, which
    continues runs/latest, another run once a second one started or where ``--out`` put this one elsewhere."""
    import errno

    from gputravel.console.cli.run_end import resume_hint
    from gputravel.core.errors import DiskFullError, StorageError
    from gputravel.core.files import storage_error

    folder = tmp_path / "elsewhere" / "run-7"
    folder.mkdir(parents=True)
    RunFolder(folder).ledger.write_bytes(b"")  # the run committed something
    full = storage_error(OSError(errno.ENOSPC, "No space left on device"), "ledger x: flush")
    hinted = resume_hint(full, folder)
    assert type(hinted) is DiskFullError and (hinted.code, hinted.exit_code) == ("disk-full", 12)
    assert f"free space, then `gputravel run --resume --out {folder}` continues" in hinted.reason, hinted.reason
    refused = resume_hint(storage_error(OSError(errno.EIO, "Input/output error"), "checkpoint y"), folder)
    assert type(refused) is StorageError and f"`gputravel run --resume --out {folder}` continues" in refused.reason
    assert resume_hint(full, tmp_path / "none") is full  # nothing committed, no folder to name: as it was
