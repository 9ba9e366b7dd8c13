"""``gputravel attest --tdx-quote``: a refusal in words, with dates and the ``--at`` that checks the collateral
inside its validity window; unreadable collateral is bad input (exit 2), not a failed attestation (issue 35.4).
The quote and collateral are the real sample (tests/data/intel-tdx, from dcap-qvl)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import DATA_DIR
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.console.cli.tdx_words import collateral_window, tdx_reason_in_words

DATA = DATA_DIR / "intel-tdx"
ARGS = ["attest", "--tdx-quote", str(DATA / "tdx_quote"), "--collateral", str(DATA / "tdx_quote_collateral.json")]
ISSUED = 1750328163  # the TCB info's issueDate, 2025-06-19T10:16:03Z


def test_expired_collateral_is_named_in_words_with_its_dates_and_the_at_hint() -> None:
    out = CliRunner().invoke(app, [*ARGS, "--at", "1795795842", "--json"])
    assert out.exit_code == 3, out.output
    doc = json.loads(out.stdout)
    words = doc["failed_reason"]
    assert "CrlExpired" not in words and "UnixTime" not in words, words
    assert words.startswith("collateral expired 2026-") and "verified as of 2026-11-27 16:10:42 UTC" in words
    assert "valid from 2025-06-19 10:16:03 to 2025-07-19 10:16:03 UTC" in words
    assert f"--at {ISSUED + 3600}" in words
    assert doc["verifier_reason"].startswith("CrlExpired {")  # dcap-qvl's own words kept beside
    assert CliRunner().invoke(app, [*ARGS, "--at", str(ISSUED + 3600)]).exit_code == 0  # the hint holds


def test_collateral_from_the_future_says_when_it_was_checked() -> None:
    out = CliRunner().invoke(app, [*ARGS, "--at", "1600000000"])
    assert out.exit_code == 3
    assert "in the future (verified as of 2020-09-13 12:26:40 UTC)" in out.stderr
    assert "verify at another time with --at" in out.stderr


def test_unreadable_collateral_is_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "collateral.json"
    bad.write_text("not json")
    out = CliRunner().invoke(app, ["attest", "--tdx-quote", str(DATA / "tdx_quote"), "--collateral", str(bad),
                                   "--json"])
    assert out.exit_code == 2, out.output
    assert json.loads(out.stdout)["error"]["type"] == "DataError" and str(bad) in out.stdout


def test_a_reason_without_times_is_kept_as_it_is() -> None:
    reason = "ISV enclave report signature is invalid"
    assert tdx_reason_in_words(reason, at=0, collateral=b"{}") == reason
    assert collateral_window(b"garbage") is None


def test_continuous_telemetry_without_a_device_says_so_once_and_waits() -> None:
    """``gputravel telemetry`` (no --once) on a machine without a driver: the reason once, then a line that it
    waits, not the same message every second (issue 35.4). With devices, every sample is a table."""
    out = CliRunner().invoke(app, ["telemetry", "--count", "4", "--interval", "0.1"])
    assert out.exit_code == 0, out.output
    if "no devices to show" not in out.stdout:  # a machine with a driver and a device: every sample shown
        assert out.stdout.count("NVML ") >= 4
        return
    assert out.stdout.count("no devices to show") == 1 and out.stdout.count("NVML not available") == 1
    assert "waiting: a sample every 0.1 s" in " ".join(out.stdout.split())


def test_the_window_is_named_as_the_tcb_infos_not_the_whole_collaterals() -> None:
    """Auditor walk, session 15: "collateral expired 2026-04-03 (a CRL's next update)" then "the collateral is valid
    from 2025-06-19 to 2025-07-19" read as a contradiction: the window is the TCB info's, and it ended first."""
    out = CliRunner().invoke(app, [*ARGS, "--at", "1795795842"])
    assert out.exit_code == 3
    words = " ".join(out.stderr.split())
    assert "the collateral is valid from" not in words
    assert "its TCB info is valid from 2025-06-19 10:16:03 to 2025-07-19 10:16:03 UTC" in words
