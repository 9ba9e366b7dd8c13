"""Every ``gputravel`` command fails under ``--json`` with the one documented error object on stdout:
``{"ok": false, "error": {"type", "message", "exit_code"}}``, its exit code the error's (issues 24.8, 25.9)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.ledger import Ledger


def _ledger(path: Path, rows: int = 4) -> Path:
    with Ledger.open(path, run_id="run-1") as ledger:
        for i in range(rows):
            ledger.append(kind="phase", phase="train", holder="alice", epoch=i, key_fp=None, nbytes=i,
                          duration_s=0.1, detail={}, state={"visit": i})
    return path


def _tampered(path: Path) -> Path:
    _ledger(path)
    db = sqlite3.connect(path)
    db.execute("UPDATE events SET nbytes = 99 WHERE seq = 3")
    db.commit()
    db.close()
    return path


def envelope(stdout: str, exit_code: int) -> dict[str, Any]:
    """The one JSON object on stdout, checked for the documented shape and the exit code."""
    doc = json.loads(stdout)  # exactly one JSON document
    assert doc["ok"] is False, doc
    assert {"type", "message", "exit_code"} <= set(doc["error"]), doc
    assert doc["error"]["exit_code"] == exit_code
    return dict(doc)


CASES = {
    "runs show": (["runs", "show", "nope"], "ConfigError", 2),
    "runs log": (["runs", "log", "nope"], "ConfigError", 2),
    "runs stop": (["runs", "stop", "nope"], "ConfigError", 2),
    "ledger show missing": (["ledger", "show", "{tmp}/missing.db"], "ConfigError", 2),
    "ledger show nosuch": (["ledger", "show", "nosuch"], "ConfigError", 2),
    "ledger show tampered": (["ledger", "show", "{tampered}"], "LedgerError", 8),
    "ledger verify missing": (["ledger", "verify", "{tmp}/missing.db"], "ConfigError", 2),
    "ledger verify nosuch": (["ledger", "verify", "nosuch"], "ConfigError", 2),
    "ledger verify tampered": (["ledger", "verify", "{tampered}"], "LedgerError", 8),
    "data check": (["data", "check", "{tmp}/no-such-folder"], "DataError", 2),
    "replay": (["replay", "{tmp}/nope.db"], "RecordingError", 2),
    "usage": (["runs", "ls", "--no-such-option"], "NoSuchOption", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_fails_under_json_with_the_one_error_object(case: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args, kind, code = CASES[case]
    tampered = _tampered(tmp_path / "tampered.db") if "tampered" in case else None
    argv = [a.format(tmp=tmp_path, tampered=tampered) for a in args] + ["--json"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == code, result.output
    doc = envelope(result.stdout, code)
    assert doc["error"]["type"] == kind
    assert "Traceback" not in result.output


def test_a_broken_chain_under_json_is_one_object_with_the_verification_and_the_rows(tmp_path: Path) -> None:
    ledger = _tampered(tmp_path / "ledger.db")
    verify = CliRunner().invoke(app, ["ledger", "verify", str(ledger), "--json"])
    doc = envelope(verify.stdout, 8)
    assert doc["first_bad_seq"] == 3 and "row 3" in doc["error"]["message"]
    show = CliRunner().invoke(app, ["ledger", "show", str(ledger), "--json"])
    doc = envelope(show.stdout, 8)
    assert [r["seq"] for r in doc["rows"]] == [1, 2, 3, 4] and "cannot be trusted" in doc["error"]["message"]


@pytest.mark.process
def test_the_installed_cli_prints_the_object_once_and_the_message_on_stderr(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "data", "check", str(tmp_path / "x"),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    doc = envelope(proc.stdout, 2)
    assert doc["error"]["type"] == "DataError" and "not a folder" in doc["error"]["message"]
    assert "DataError" in proc.stderr and "Traceback" not in proc.stderr


def test_a_data_folder_the_run_refuses_prints_its_error_and_no_progress_bars(tmp_path: Path) -> None:
    """Operator walk (session 15): ``gputravel run --data`` of a folder with an empty holder folder drew the run's
    three progress bars, empty (``visits 0/?``, ``phase 0/8``, ``provisioning 0/1``), above its error: the bars
    show from the run's first event on, so input refused before the run starts prints the error alone."""
    (tmp_path / "data" / "alice").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(tmp_path / "data"),
                           "--transport", "local", "--out", str(tmp_path / "run"), "--json"],
                          capture_output=True, text=True, timeout=120)
    doc = envelope(proc.stdout, 2)
    assert doc["error"]["type"] == "DataError" and "empty holder folder" in doc["error"]["message"]
    assert "error: DataError" in proc.stderr
    assert not any(bar in proc.stderr for bar in ("visits", "phase", "provisioning")), proc.stderr
    assert not (tmp_path / "run").exists()  # and nothing was left behind


def test_agents_that_cannot_be_reached_are_the_one_error_object_with_every_holder(tmp_path: Path) -> None:
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(tmp_path / "client"))
    (tmp_path / "client").chmod(0o600)
    pub = key.export_public_key().decode().strip()
    (tmp_path / "holders.toml").write_text(
        f'[[holder]]\nname = "alice"\nhost = "127.0.0.1"\nport = 1\nuser = "u"\nclient_key = "client"\n'
        f'data = "/srv/a"\nhost_key = "{pub}"\nconnect_timeout = 5\n')
    result = CliRunner().invoke(app, ["agents", "status", "--holders-file", str(tmp_path / "holders.toml"),
                                      "--json"])
    assert result.exit_code == 6, result.output
    doc = envelope(result.stdout, 6)
    assert doc["error"]["type"] == "AgentError" and "alice" in doc["error"]["message"]
    assert [h["state"] for h in doc["holders"]] == ["offline"]


def test_a_bench_study_where_every_run_failed_is_the_one_error_object_with_its_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gputravel.core.bench import travel

    def every_run_failed(buffers: Any, **kw: Any) -> dict[str, Any]:
        return {"rows": [{"buffer_mib": b, "status": "failed", "reason": "device died"} for b in buffers]}

    monkeypatch.setattr(travel, "study", every_run_failed)
    result = CliRunner().invoke(app, ["bench", "travel", "--buffer-mib", "1,2", "--json"])
    assert result.exit_code == 1, result.output
    doc = envelope(result.stdout, 1)
    assert doc["error"]["type"] == "GpuTravelError" and "every run of the study failed" in doc["error"]["message"]
    assert [r["status"] for r in doc["rows"]] == ["failed", "failed"]


@pytest.mark.process
def test_a_bug_under_json_still_prints_the_one_error_object_and_its_traceback(tmp_path: Path) -> None:
    code = ("import sys; from gputravel.console.cli.commands import runs; "
            "runs.list_runs = lambda *a, **k: 1 / 0; "
            "sys.argv = ['gputravel', 'runs', 'ls', '--json']; "
            "from gputravel.console.cli import main as cli; cli.main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    doc = envelope(proc.stdout, 1)
    assert doc["error"]["type"] == "ZeroDivisionError" and "a bug in gputravel" in doc["error"]["message"]
    assert "Traceback" in proc.stderr
