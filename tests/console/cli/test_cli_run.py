"""``gputravel run`` and ``gputravel ledger verify`` as an operator runs them: separate processes."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_holders

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
NORTH_SOUTH = {"north": 0, "south": 1}  # the two holders' seeds


def gputravel(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd, preexec_fn=lambda: os.umask(0o022))  # a usual umask


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    out = root / "out"
    # no --holders: it follows the --data folders (2 here; the default without --data is 3). Paths relative to
    # the operator's folder, as `make demo` gives them: the agents behind SSH run in their own home
    proc = gputravel("run", "--data", "data", "--rounds", "1", "--steps-per-visit", "2",
                     "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25",
                     "--out", "out", "--telemetry-interval", "0.2", "--json", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout), proc


def test_the_run_folder_and_everything_in_it_are_private(
        finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]) -> None:
    out = finished_run[0]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in out.rglob("*")
             if not p.is_symlink()}
    assert {"ledger.db", "recording.db", "settings.json"} <= set(modes)
    wide = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not wide, f"readable by others: {wide}"


def test_the_ledgers_and_recordings_sqlite_side_files_are_private_while_open(tmp_path: Path) -> None:
    code = """
import os, stat, sys
from pathlib import Path
os.umask(0o022)
from gputravel.core.runfolder import RunClaim
from gputravel.core.ledger import Ledger
from gputravel.core.recording import Recorder
out = Path(sys.argv[1])
RunClaim(out).claim()
rec = Recorder(out / "recording.db", meta={})
rec.set_meta({"x": 1})
with Ledger.open(out / "ledger.db", run_id="r") as ledger:
    ledger.append(kind="phase", phase="train", holder="a", epoch=1, key_fp=None, nbytes=1, duration_s=0.1,
                  detail={}, state={})
    for p in sorted(out.iterdir()):
        print(p.name, oct(stat.S_IMODE(p.stat().st_mode)))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    modes = dict(line.split() for line in proc.stdout.splitlines())
    assert {"ledger.db-wal", "ledger.db-shm", "recording.db-wal"} <= set(modes), modes
    assert set(modes.values()) == {"0o600"}, modes
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700


def test_holders_follow_the_data_folders_and_the_report_ends_with_the_whole_head(
        finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]) -> None:
    out, report, _ = finished_run
    assert sorted(h["name"] for h in report["holders"]) == ["north", "south"]
    assert report["ledger"]["head"] and len(report["ledger"]["head"]) == 64
    assert json.loads((out / "status.json").read_text())["status"] == "completed"


def test_run_prints_a_json_report(finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]) -> None:
    out, report, proc = finished_run
    assert report["platform"]["kind"] == "emulated"
    assert report["platform"]["sim"] is True
    assert report["attestation"]["ok"] is True
    visits = report["visits"]
    assert [v["holder"] for v in visits] == ["north", "south"]
    for v in visits:
        assert v["outcome"] == "done"
        assert isinstance(v["epoch"], int) and v["epoch"] > 0
        assert isinstance(v["key_fingerprint"], str) and len(v["key_fingerprint"]) >= 8
        assert v["bytes"] > 0
        assert v["provision_s"] > 0 and v["train_s"] > 0
        assert v["integrity_ok"] is True and v["scrub_verified"] is True
    assert len({v["epoch"] for v in visits}) == len({v["key_fingerprint"] for v in visits}) == 2
    training = report["training"]
    for name in ("loss_first", "loss_last", "val_loss"):
        assert isinstance(training[name], float), name
    assert training["steps"] == 4
    assert report["ledger"]["path"] == str(out / "ledger.db")
    assert report["ledger"]["verified"] is True
    assert report["failed_visits"] == 0
    assert "SIM" in proc.stderr  # the progress view on stderr says the GPU is emulated


def test_the_hand_off_pipelining_is_on_by_default_and_each_part_can_be_turned_off(
        finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    """By default each holder attests ahead of its hand-off (the first while the run sets up, the next while a
    visit trains) and a HANDOFF rides the window's request where the holder's data connection is parked; ``--no-attest-prefetch --no-handoff-with-window`` attests every hand-off in line over SSH, and the
    run's settings.json says which was used (a resume keeps it)."""
    out, report, _ = finished_run
    assert all(v["attest_prefetched"] for v in report["visits"])
    saved = json.loads((out / "settings.json").read_text())
    assert saved["attest_prefetch"] is True and saved["handoff_with_window"] is True
    assert saved["grant_at_completion"] is True  # on by default since session 14 (docs/performance.md)
    data = tmp_path / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    proc = gputravel("run", "--data", "data", "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "4",
                     "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", "off", "--no-record",
                     "--no-attest-prefetch", "--no-handoff-with-window", "--no-grant-at-completion", "--json",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    off = json.loads(proc.stdout)
    assert [v["outcome"] for v in off["visits"]] == ["done", "done"]
    assert not any(v["attest_prefetched"] or v["handoff_relayed"] for v in off["visits"])
    saved = json.loads((tmp_path / "off" / "settings.json").read_text())
    assert saved["attest_prefetch"] is False and saved["handoff_with_window"] is False
    assert saved["grant_at_completion"] is False


def test_run_records_events_and_gpu_telemetry(finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]
                                              ) -> None:
    from gputravel.core.recording import load_recording

    out, report, _ = finished_run
    recording = load_recording(out / "recording.db")
    assert recording.meta["source"] == "gputravel run"
    assert recording.meta["holders"] == ["north", "south"]
    assert recording.meta["ledger"] == str(out / "ledger.db")
    kinds = {e.kind for e in recording.events()}
    assert {"RunStarted", "RunCompleted"} <= kinds
    frames = recording.frames()
    assert len(frames) >= 2, "the run samples telemetry every 0.2 s while it goes"
    # once the device is attested its counters are read: SIM samples with memory in use, tagged with the phase
    sim = [d for f in frames for d in f.devices if d.sim]
    assert any(isinstance(d.mem_used, int) and d.mem_used > 0 for d in sim), [d.note for d in sim]
    assert any(f.phase for f in frames)


def test_ledger_verify_passes_then_names_a_changed_row(
        finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]) -> None:
    out, report, _ = finished_run
    db = out / "ledger.db"
    ok = gputravel("ledger", "verify", str(db))
    assert ok.returncode == 0, ok.stderr
    assert "intact" in ok.stdout and f"{report['ledger']['rows']} rows" in ok.stdout

    with sqlite3.connect(db) as con:
        seq, detail = con.execute(
            "SELECT seq, detail FROM events WHERE kind = 'visit-completed' ORDER BY seq LIMIT 1").fetchone()
        i = detail.index('"visit":0') + len('"visit":')
        changed = detail[:i] + "1" + detail[i + 1:]  # one byte of one stored field
        assert len(changed) == len(detail) and changed != detail
        con.execute("UPDATE events SET detail = ? WHERE seq = ?", (changed, seq))
    con.close()

    broken = gputravel("ledger", "verify", str(db))
    assert broken.returncode == 8, broken.stdout + broken.stderr
    assert f"row {seq}" in broken.stderr
    assert "hash mismatch" in broken.stderr


def test_finished_run_says_how_it_ended_and_runs_lists_it(
        finished_run: tuple[Path, dict, subprocess.CompletedProcess[str]]) -> None:
    from gputravel.core.recording import load_recording

    out, report, _ = finished_run
    recording = load_recording(out / "recording.db")
    assert recording.meta["status"] == "completed"  # the recording says how the run ended
    assert not (out / "orchestrator.pid").exists()  # the pid file lives only while the run goes
    listed = gputravel("runs", "ls", "--runs-dir", str(out.parent), "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = [r for r in json.loads(listed.stdout)["runs"] if r["name"] == "out"]
    assert (run["status"], run["visits_done"], run["visits_planned"]) == ("completed", 2, 2)
    shown = gputravel("runs", "show", "out", "--runs-dir", str(out.parent), "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["run_id"] == report["run_id"] and detail["summary"]["status"] == "completed"
    log = gputravel("runs", "log", str(out), "--json")
    events = [json.loads(line) for line in log.stdout.splitlines()]
    assert events[0]["kind"] == "DeviceAttested" or events[0]["kind"].startswith("Holder")
    assert events[-1]["kind"] == "RunCompleted"


def test_runs_stop_ends_a_running_run_and_its_recording_says_cancelled(tmp_path: Path) -> None:
    import time

    from gputravel.core.recording import load_recording

    data = tmp_path / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    out = tmp_path / "runs" / "run-stopped"
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(data), "--holders",
                             "2", "--rounds", "50", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32",
                             "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out), "--transport", "local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(600):  # until the run has started visiting
            if (out / "recording.db").exists() and "PhaseStarted" in gputravel("runs", "log", str(out), "--json").stdout:
                break
            time.sleep(0.1)
        running = gputravel("runs", "show", str(out), "--json")
        assert json.loads(running.stdout)["status"] == "running"
        assert json.loads(running.stdout)["pid"] == proc.pid
        stop = gputravel("runs", "stop", "run-stopped", "--runs-dir", str(tmp_path / "runs"), "--json")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert json.loads(stop.stdout)["stopped"] is True
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130  # CancelledRunError's exit code
    # how to continue names this very run (a plain --resume takes runs/latest: another run once one has started)
    assert f"stopped by SIGTERM (gputravel runs stop); what was committed is kept: `gputravel run --resume --out {out}`" \
        in " ".join(stderr.split()), stderr[-600:]
    recording = load_recording(out / "recording.db")
    (last,) = [e for e in recording.events() if e.kind in ("RunCompleted", "RunFailed")]
    assert last.kind == "RunFailed" and last.code == "cancelled"  # type: ignore[attr-defined]
    assert recording.meta["status"] == "cancelled"
    again = gputravel("runs", "stop", str(out), "--json")  # a JSON error, with the error's exit code
    assert again.returncode == 2
    assert json.loads(again.stdout)["error"]["code"] == "config"
    assert "not running (cancelled)" in json.loads(again.stdout)["error"]["message"]


def test_ctrl_c_says_how_to_resume_this_run_by_its_folder(tmp_path: Path) -> None:
    """Ctrl-C mid-run: exit 130 and a hint that names the run's own folder (``--out``), which resumes it."""
    import signal
    import time

    data = tmp_path / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    out = tmp_path / "elsewhere" / "run-interrupted"
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a terminal
            "from gputravel.console.cli.main import main\nsys.argv[0] = 'gputravel'\nmain()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "run", "--data", str(data), "--holders", "2", "--rounds",
                             "50", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32", "--chunk-kib",
                             "16", "--buffer-mib", "0.25", "--out", str(out), "--transport", "local", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        for _ in range(600):  # until the run has committed a visit
            if "visit-completed" in gputravel("ledger", "show", str(out), "--json").stdout:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    error = json.loads(stdout)["error"]
    assert error["code"] == "cancelled" and error["message"].startswith("cancelled (Ctrl-C); what was committed")
    assert f"`gputravel run --resume --out {out}` continues it" in error["message"]


def test_a_headless_breakpoint_says_how_to_continue_and_runs_resume_and_step_continue_it(tmp_path: Path) -> None:
    import time

    data = tmp_path / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    out = tmp_path / "runs" / "run-break"
    env = {**os.environ, "COLUMNS": "300", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(data), "--rounds",
                             "1", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32", "--chunk-kib",
                             "16", "--buffer-mib", "0.25", "--out", str(out), "--transport", "local",
                             "--break-before", "train"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    runs = ("--runs-dir", str(tmp_path / "runs"))

    def status() -> str:
        shown = gputravel("runs", "show", "run-break", *runs, "--json")
        return str(json.loads(shown.stdout)["status"]) if shown.returncode == 0 else "?"

    def until_paused() -> None:
        for _ in range(600):
            if status() == "paused" or proc.poll() is not None:
                return
            time.sleep(0.1)

    try:
        until_paused()  # before the first visit's TRAIN
        assert status() == "paused" and proc.poll() is None
        step = gputravel("runs", "step", "run-break", *runs, "--json")
        assert step.returncode == 0, step.stdout + step.stderr
        assert json.loads(step.stdout)["action"] == "step"
        for _ in range(4):  # the second visit's TRAIN breakpoint, and then the end
            until_paused()
            if proc.poll() is not None:
                break
            resumed = gputravel("runs", "resume", "run-break", *runs, "--json")
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
            time.sleep(0.5)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-2000:]
    assert "paused (breakpoint) before TRAIN" in output
    assert "gputravel runs resume run-break" in output and "gputravel runs step run-break" in output
    assert status() == "completed"
    gone = gputravel("runs", "resume", "run-break", *runs, "--json")
    assert gone.returncode == 2 and "not running (completed)" in json.loads(gone.stdout)["error"]["message"]


def test_a_completed_fleet_says_completed_and_is_addressed_by_its_name(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_holders(data, NORTH_SOUTH, WORDS, 12_000, file="text.txt", newline=False)
    out = tmp_path / "runs" / "fleet-run"
    proc = gputravel("run", "--gpus", "2", "--data", str(data), "--rounds", "1", "--steps-per-visit", "2",
                     "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25",
                     "--transport", "local", "--out", str(out), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    runs = ("--runs-dir", str(tmp_path / "runs"))
    shown = json.loads(gputravel("runs", "show", "fleet", *runs, "--json").stdout)
    assert (shown["status"], shown["fleet"], shown["visits_done"]) == ("completed", True, 2)
    log = gputravel("runs", "log", "fleet", *runs, "--json")
    assert log.returncode == 0 and {json.loads(line)["gpu"] for line in log.stdout.splitlines()} == {0, 1}
    assert stat.S_IMODE(out.stat().st_mode) == 0o700


def test_the_headless_pause_hint_keeps_each_command_whole_within_80_columns() -> None:
    """Issue 25.8/9: a command cut by the terminal's wrap cannot be pasted; one command a line, each within
    80 columns for a default run name."""
    from gputravel.console.cli.run_view import continue_hint

    lines = continue_hint("run-20261126-005429").splitlines()
    assert all(len(line) <= 80 for line in lines)
    commands = [line.split(":", 1)[-1].split("(")[0].strip() for line in lines]
    assert commands == ["gputravel runs resume run-20261126-005429", "gputravel runs step run-20261126-005429",
                        f"kill -USR1 {os.getpid()}", "gputravel runs stop run-20261126-005429"]
