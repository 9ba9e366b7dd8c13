"""The installed CLI reports usage and gputravel errors with their exit codes, never a traceback."""

from __future__ import annotations

import subprocess
import sys


def gputravel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_bad_parameter_exits_2_with_a_message_and_no_traceback() -> None:
    proc = gputravel("bench", "provision", "--path", "foo")
    assert proc.returncode == 2
    assert "unknown path 'foo'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_option_exits_2() -> None:
    proc = gputravel("run", "--no-such-option")
    assert proc.returncode == 2 and "No such option" in proc.stderr and "Traceback" not in proc.stderr


def test_a_gputravel_error_maps_to_its_exit_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = gputravel("ledger", "verify", str(tmp_path / "missing.db"))
    assert proc.returncode == 8 and "Traceback" not in proc.stderr
