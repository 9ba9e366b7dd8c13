"""A full disk stops a run with a named error, keeps what was committed, and ``--resume`` finishes it once
space is back (issue 24, "full disk").

Each writer of the run's durable state meets a real full filesystem: a small tmpfs mounted (we are root in the
test machine; without the right to mount, the tests skip and say so) where the writer writes, filled with a
file. The checkpoint store and the recording meet it through the CLI (exit 12, the JSON error), the ledger
in-process at a chosen point (a sink fills the disk as visit 1's ROTATE is recorded, so the next row, the one
that commits visit 1, cannot be written). Each time: ``DiskFullError`` (exit 12), the ledger verifies, the
visits committed before are there, no partial checkpoint carries a checkpoint's name; the filler is removed
and ``gputravel run --resume`` ends where an uninterrupted run ends (the model digest bit for bit, every
visit completed once, no epoch reused).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import fill, gputravel_children, small_disk

from gputravel.console.entries import ENTRIES
from gputravel.core import events as ev
from gputravel.core.api import RunSettings, run
from gputravel.core.errors import DiskFullError, StorageError
from gputravel.core.ledger import read_rows, verify_ledger

pytestmark = pytest.mark.slow  # each case is three runs of the CLI (the reference, the full disk, the resume)

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls sing softly at night".split()
ARGS = ["--holders", "2", "--rounds", "1", "--steps-per-visit", "3", "--batch-size", "4", "--seq-len", "32",
        "--chunk-kib", "16", "--buffer-mib", "0.25", "--transport", "local"]
MIB = 1 << 20


def gputravel(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("diskdata")
    for i, name in enumerate(("alice", "bob")):
        rng = random.Random(i)
        (root / name).mkdir()
        (root / name / "part.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(16000)))
    return root


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run; it keeps all three checkpoints, so their sizes are known."""
    out = tmp_path_factory.mktemp("ref") / "run"
    proc = gputravel("run", "--data", str(data), *ARGS, "--keep-checkpoints", "3", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    sizes = {int(p.name[5:11]): p.stat().st_size for p in (out / "checkpoints").glob("ckpt-*.gtc")}
    assert sorted(sizes) == [0, 1, 2], sizes
    report["_ckpt_sizes"] = sizes
    return report


def check_stopped_clean(out: Path, *, committed: set[int]) -> None:
    """After the full disk: the ledger verifies, the visits committed before are there, and nothing else is."""
    assert verify_ledger(out / "ledger.db").ok
    rows = list(read_rows(out / "ledger.db"))
    assert {r.detail["visit"] for r in rows if r.kind == "visit-completed"} == committed
    assert not list((out / "checkpoints").glob(".ckpt-tmp-*")), "a partial checkpoint was left behind"


def resume_and_check(out: Path, reference: dict[str, Any], *extra: str) -> dict[str, Any]:
    proc = gputravel("run", "--resume", "--out", str(out), "--json", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]
    assert report["training"]["steps"] == reference["training"]["steps"]
    rows = list(read_rows(out / "ledger.db"))
    completed = Counter(r.detail["visit"] for r in rows if r.kind == "visit-completed")
    assert completed == Counter({0: 1, 1: 1}), completed  # each holder part trained exactly once
    epochs = [r.epoch for r in rows if r.kind == "phase" and r.phase == "HANDOFF"]
    assert len(epochs) == len(set(epochs)), f"an epoch was reused: {epochs}"
    assert any(r.kind == "resumed" for r in rows)
    assert verify_ledger(out / "ledger.db").ok
    return report


def json_error(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    body = json.loads(proc.stdout)
    assert body["ok"] is False, body
    error: dict[str, Any] = body["error"]
    return error


def test_a_full_checkpoint_disk_stops_the_run_with_disk_full_keeps_visit_0_and_resume_finishes(
        data: Path, tmp_path: Path, reference: dict[str, Any]) -> None:
    """The checkpoint folder has room for the initial checkpoint and visit 0's, not visit 1's: the run stops
    with DiskFullError (exit 12), visit 0 stays committed, the partial file is gone; once the filler is removed
    ``--resume`` redoes visit 1 and ends with the uninterrupted run's model."""
    sizes = reference["_ckpt_sizes"]
    initial, full = sizes[0], max(sizes[1], sizes[2])
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    size = initial + 2 * full + 2 * MIB  # room for the resume: the two kept and one being written
    with small_disk(out / "checkpoints", size) as disk:
        filler = fill(disk, size - (initial + full + full // 2))  # visit 1's checkpoint stops half-way
        proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json")
        assert proc.returncode == DiskFullError.exit_code == 12, (proc.returncode, proc.stderr[-2000:])
        error = json_error(proc)
        assert (error["type"], error["code"], error["exit_code"]) == ("DiskFullError", "disk-full", 12)
        assert "checkpoint" in error["message"] and f"`gputravel run --resume --out {out}`" in error["message"]
        check_stopped_clean(out, committed={0})
        last = list(read_rows(out / "ledger.db"))[-1]
        assert (last.kind, last.outcome) == ("run-failed", "disk-full")
        assert sorted(p.name for p in disk.glob("ckpt-*.gtc")) == ["ckpt-000000.gtc", "ckpt-000001.gtc"]
        filler.unlink()
        resume_and_check(out, reference)


def test_a_full_disk_under_the_ledger_stops_the_run_keeps_the_chain_and_resume_finishes(
        data: Path, tmp_path: Path, reference: dict[str, Any]) -> None:
    """The run folder's disk fills as visit 1's ROTATE is recorded: the row that commits visit 1 cannot be
    written, the run stops with DiskFullError (no traceback, not ``internal``), the chain ends at the last row
    committed and verifies, visit 0 is committed; with space back ``--resume`` redoes visit 1."""
    out = tmp_path / "run"
    with small_disk(out, 48 * MIB) as disk, small_disk(out / "checkpoints", 64 * MIB):
        fillers: list[Path] = []

        def fill_at_visit_1_rotate(event: ev.Event) -> None:
            if isinstance(event, ev.PhaseCompleted) and (event.visit, event.phase) == (1, "ROTATE") and not fillers:
                fillers.append(fill(disk))  # until the disk refuses

        settings = RunSettings(out_dir=out, data_dir=data, holders=2, rounds=1, steps_per_visit=3, batch_size=4,
                               seq_len=32, chunk_kib=16, buffer_mib=0.25, transport="local")
        with pytest.raises(DiskFullError) as caught:
            asyncio.run(run(settings, entries=ENTRIES, sinks=[fill_at_visit_1_rotate]))
        assert fillers, "the disk was never filled"
        assert isinstance(caught.value, StorageError) and caught.value.exit_code == 12
        assert "ledger" in caught.value.reason and "visit-completed" in caught.value.reason
        check_stopped_clean(out, committed={0})
        assert gputravel_children() == [], "the holders' agents outlived the failed run"
        rows = list(read_rows(out / "ledger.db"))
        assert rows[-1].kind == "phase" and rows[-1].phase == "ROTATE" and rows[-1].detail["visit"] == 1
        fillers[0].unlink()
        resume_and_check(out, reference)


def test_a_full_disk_under_the_recording_stops_the_run_with_disk_full_and_resume_finishes(
        data: Path, tmp_path: Path, reference: dict[str, Any]) -> None:
    """``--record`` on a disk with 192 KiB left: the recording fills mid-run, the run stops with DiskFullError
    (exit 12) naming the recording, the ledger verifies and keeps what was committed; the recording written so
    far still reads; with space back ``--resume`` (recording to the same file) finishes the run."""
    from gputravel.core.recording import load_recording

    out = tmp_path / "run"
    with small_disk(tmp_path / "rec", 8 * MIB) as disk:
        filler = fill(disk, 8 * MIB - 192 * 1024)
        record = disk / "recording.db"
        proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--record", str(record), "--json")
        assert proc.returncode == 12, (proc.returncode, proc.stderr[-2000:])
        error = json_error(proc)
        assert (error["type"], error["code"]) == ("DiskFullError", "disk-full")
        assert "recording" in error["message"] and f"`gputravel run --resume --out {out}`" in error["message"]
        assert verify_ledger(out / "ledger.db").ok
        rows = list(read_rows(out / "ledger.db"))
        assert (rows[-1].kind, rows[-1].outcome) == ("run-failed", "disk-full")
        committed = {r.detail["visit"] for r in rows if r.kind == "visit-completed"}
        assert load_recording(record).events(), "what was recorded before the disk filled is readable"
        filler.unlink()
        report = resume_and_check(out, reference, "--record", str(record))
        assert committed <= {0, 1} and report["failed_visits"] == 0
        assert any(e.kind == "RunCompleted" for e in load_recording(record).events())


def test_a_run_whose_whole_folder_fills_says_so_in_runs_ls_and_show(data: Path, tmp_path: Path) -> None:
    """Operator walk (session 15): a run folder on a small disk (its checkpoints on another) fills under the
    ledger or the recording; the run stops with DiskFullError (exit 12), and ``runs ls`` / ``runs show`` said
    ``died``: status.json needed the full disk too. The run keeps room for it, so they say ``failed: disk full``
    with the run's own error, as ``--json`` does (``code``)."""
    out = tmp_path / "runs" / "run-small"
    with small_disk(out, 600 * 1024), small_disk(out / "checkpoints", 64 * MIB):
        proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json")
        assert proc.returncode == 12, (proc.returncode, proc.stderr[-2000:])
        assert json_error(proc)["code"] == "disk-full"
        shown = gputravel("runs", "show", "run-small", "--runs-dir", str(tmp_path / "runs"), "--json")
        doc = json.loads(shown.stdout)
        assert (doc["status"], doc["code"]) == ("failed", "disk-full"), doc
        assert "no space left" in doc["error"]
        listed = gputravel("runs", "ls", "--runs-dir", str(tmp_path / "runs"))
        assert "failed: disk full" in listed.stdout and "died" not in listed.stdout, listed.stdout
