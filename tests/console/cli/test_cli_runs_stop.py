"""``gputravel runs stop`` signals only the process its run recorded (pid, start time and command line from
/proc), never whatever process holds the pid now (issue 24.6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.procs import process_identity


@pytest.fixture
def bystander() -> Any:
    """An unrelated live process (a ``sleep`` this test starts) that must never be signalled."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def _run_folder(tmp_path: Path, marker: dict[str, Any]) -> Path:
    run = tmp_path / "runs" / "run-stale"
    run.mkdir(parents=True)
    (run / "settings.json").write_text("{}")
    (run / "orchestrator.pid").write_text(json.dumps(marker))
    return run


def _stop(tmp_path: Path) -> Any:
    return CliRunner().invoke(app, ["runs", "stop", "run-stale", "--runs-dir", str(tmp_path / "runs"), "--json"])


def _still_sleeping(proc: subprocess.Popen[bytes]) -> bool:
    time.sleep(0.2)
    return proc.poll() is None


def test_a_stale_pid_file_naming_an_unrelated_process_signals_nothing(tmp_path: Path, bystander: Any) -> None:
    # the run died by kill -9 and its pid was reused: the file still says the run's own start time and command
    me = process_identity(os.getpid())
    assert me is not None
    _run_folder(tmp_path, {"pid": bystander.pid, "start_ticks": me.start_ticks, "cmdline": list(me.cmdline),
                           "owner": "gputravel run"})
    result = _stop(tmp_path)
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "ConfigError" and f"pid {bystander.pid}" in error["message"]
    assert "another process" in error["message"] and "nothing signalled" in error["message"]
    assert _still_sleeping(bystander)


def test_a_pid_file_that_does_not_say_who_it_names_signals_nothing(tmp_path: Path, bystander: Any) -> None:
    _run_folder(tmp_path, {"pid": bystander.pid, "owner": "gputravel run"})  # an old-style file: pid only
    result = _stop(tmp_path)
    assert result.exit_code == 2 and "nothing signalled" in json.loads(result.stdout)["error"]["message"]
    assert _still_sleeping(bystander)
    shown = CliRunner().invoke(app, ["runs", "show", "run-stale", "--runs-dir", str(tmp_path / "runs"), "--json"])
    assert json.loads(shown.stdout)["status"] != "running"  # nor is that process taken for the run


def test_the_recorded_process_itself_is_signalled(tmp_path: Path) -> None:
    # a stand-in orchestrator that writes its own record, as gputravel run does, and waits for SIGTERM
    code = ("import sys, signal, time; from pathlib import Path; "
            "from gputravel.core.runfolder import mark_running; "
            "mark_running(Path(sys.argv[1]), owner='gputravel run'); "
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(300)")
    run = tmp_path / "runs" / "run-live"
    run.mkdir(parents=True)
    (run / "settings.json").write_text("{}")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)])
    try:
        for _ in range(300):
            if (run / "orchestrator.pid").exists():
                break
            time.sleep(0.05)
        result = CliRunner().invoke(app, ["runs", "stop", "run-live", "--runs-dir", str(tmp_path / "runs"),
                                          "--json", "--wait", "10"])
        assert proc.wait(timeout=30) == 0  # it got SIGTERM and exited through its handler
        assert json.loads(result.stdout)["signal"] == "SIGTERM"
        assert json.loads(result.stdout)["pid"] == proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
