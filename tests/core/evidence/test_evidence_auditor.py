"""Session 15's walk as a security auditor through the real evidence (virtee's Milan SEV-SNP report and VCEK,
dcap-qvl's TDX quote and collateral: tests/data/): what the verdicts say was checked, what was not, and how each
tampering is refused. Each test failed before its fix (docs/attestation.md, "Walked through as an auditor")."""

from __future__ import annotations

import json

from helpers import DATA_DIR
from helpers import MILAN_REPORT as REPORT
from helpers import MILAN_VCEK as VCEK
from helpers import TDX_COLLATERAL as COLLATERAL
from helpers import TDX_QUOTE as QUOTE
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.evidence.policy import SnpPolicy, TdxPolicy
from gputravel.core.evidence.snp import verify_snp_report
from gputravel.core.evidence.tdx import verify_tdx_quote

SNP = DATA_DIR / "amd-snp"
TDX = DATA_DIR / "intel-tdx"
MEASUREMENT = "7a1e5c266c0108dbc9bb94fa926951320940915d0aafb42464bd88b579ea158d3e1a0dc39b2c60bd95b9c480cd81841f"
AT = 1750331763  # the TCB info's issueDate + 1 h (tests/data/intel-tdx/README.md)
MR_TD = "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"


# --- an empty allow-list is "not checked", never a passed check -------------------------------------------------
def test_snp_empty_allow_lists_are_not_checked_not_passed() -> None:
    verdict = verify_snp_report(REPORT, VCEK)  # the shipped defaults: min_tcb {} and empty allow-lists
    assert verdict.ok, verdict.reason
    doc = verdict.to_json()
    for claim in ("min-tcb", "measurement", "host-data", "id-key-digest"):
        assert claim not in doc["checks"], claim
        assert "any" in doc["not_checked"][claim], doc["not_checked"]
    pinned = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(measurement=(MEASUREMENT,),
                                                              min_tcb=(("snp", 8),)))
    assert pinned.checks["measurement"] is True and pinned.checks["min-tcb"] is True
    assert "measurement" not in pinned.to_json()["not_checked"]


def test_tdx_empty_allow_lists_are_not_checked_not_passed() -> None:
    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT)
    assert verdict.ok, verdict.reason
    doc = verdict.to_json()
    for claim in ("mr-td", "rtmr0", "rtmr1", "rtmr2", "rtmr3"):
        assert claim not in doc["checks"] and "any" in doc["not_checked"][claim], claim
    pinned = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(mr_td=(MR_TD,)))
    assert pinned.checks["mr-td"] is True and "mr-td" not in pinned.to_json()["not_checked"]


def test_the_tables_mark_what_was_not_checked() -> None:
    out = CliRunner().invoke(app, ["attest", "--snp-report", str(SNP / "report_milan.hex"), "--vcek",
                                   str(SNP / "vcek_milan.der")], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    line = next(x for x in out.stdout.splitlines() if " measurement " in x and "✓" not in x and "7a1e" not in x)
    assert "not checked" in line, out.stdout
    doc = json.loads(CliRunner().invoke(app, ["attest", "--tdx-quote", str(TDX / "tdx_quote"), "--collateral",
                                              str(TDX / "tdx_quote_collateral.json"), "--at", str(AT),
                                              "--json"]).stdout)
    assert "mr-td" in doc["not_checked"]


# --- the report data an auditor expects (the nonce it sent) is checked when given, and named when not -----------
REPORT_DATA = REPORT[0x50:0x90]


def test_snp_report_data_given_must_match() -> None:
    assert verify_snp_report(REPORT, VCEK, expected_report_data=REPORT_DATA).checks["report-data-match"] is True
    other = verify_snp_report(REPORT, VCEK, expected_report_data=b"\x01" * 32)
    assert not other.ok and other.failed == "report-data-match"
    assert REPORT_DATA.hex()[:16] in other.reason and "replay" in other.reason
    assert "report-data-match" in verify_snp_report(REPORT, VCEK).not_checked


def test_tdx_report_data_given_must_match() -> None:
    data = bytes.fromhex(verify_tdx_quote(QUOTE, COLLATERAL, now=AT).report_data)
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=AT, expected_report_data=data).checks["report-data-match"]
    other = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, expected_report_data=data[:32])  # zero-padded: differs
    assert not other.ok and other.failed == "report-data-match"
    assert "report-data-match" in verify_tdx_quote(QUOTE, COLLATERAL, now=AT).not_checked


def test_cli_report_data_refuses_a_mismatch_with_exit_3_and_bad_hex_with_exit_2() -> None:
    snp = ["attest", "--snp-report", str(SNP / "report_milan.hex"), "--vcek", str(SNP / "vcek_milan.der")]
    assert CliRunner().invoke(app, [*snp, "--report-data", REPORT_DATA.hex()]).exit_code == 0
    out = CliRunner().invoke(app, [*snp, "--report-data", "00" * 64, "--json"])
    assert out.exit_code == 3 and json.loads(out.stdout)["failed_claim"] == "report-data-match"
    assert "attestation failed: report-data-match" in out.stderr
    assert CliRunner().invoke(app, [*snp, "--report-data", "xyz"]).exit_code == 2
    tdx = ["attest", "--tdx-quote", str(TDX / "tdx_quote"), "--collateral", str(TDX / "tdx_quote_collateral.json"),
           "--at", str(AT)]
    out = CliRunner().invoke(app, [*tdx, "--report-data", "00" * 64, "--json"])
    assert out.exit_code == 3 and json.loads(out.stdout)["failed_claim"] == "report-data-match"


# --- another chip's VCEK: the refusal says so and what to do ------------------------------------------------------
def test_another_chips_vcek_is_named_as_such_with_what_to_do() -> None:
    """The Azure sample's VCEK is a real Milan VCEK of another chip (tests/data/azure-vtpm/README.md): the chain
    holds, the signature cannot; the reason names the two chip ids and where the right VCEK comes from."""
    other = (DATA_DIR / "azure-vtpm" / "certs.crt").read_bytes()
    verdict = verify_snp_report(REPORT, other)
    assert not verdict.ok and verdict.failed == "report-signature-verified"
    assert "another chip" in verdict.reason and REPORT[0x1A0:0x1A8].hex() in verdict.reason
    assert "--kds-url" in verdict.reason
    flipped = bytearray(REPORT)
    flipped[0x90] ^= 1  # the right VCEK, a changed measurement: no word of another chip
    assert "another chip" not in verify_snp_report(bytes(flipped), VCEK).reason


# --- the JSON says when it was verified, against what dates, and why it failed ----------------------------------
def test_snp_json_names_the_time_the_vcek_dates_and_the_reason() -> None:
    base = ["attest", "--snp-report", str(SNP / "report_milan.hex"), "--vcek", str(SNP / "vcek_milan.der"), "--json"]
    doc = json.loads(CliRunner().invoke(app, [*base, "--at", str(AT)]).stdout)
    assert doc["verified_at"] == "2025-06-19T11:16:03Z" and doc["product"] == "milan"
    assert doc["vcek"]["issuer"] == "SEV-Milan" and doc["vcek"]["not_after"].startswith("2030-04-03")
    assert doc["failed_reason"] is None
    out = CliRunner().invoke(app, [*base, "--at", "2000000000"])  # 2033: after the VCEK's end
    doc = json.loads(out.stdout)
    assert out.exit_code == 3 and doc["failed_claim"] == "cert-chain-validated"
    assert "2030-04-03" in doc["failed_reason"] and doc["verified_at"] == "2033-05-18T03:33:20Z"


def test_tdx_json_names_the_time_and_the_collaterals_window() -> None:
    out = CliRunner().invoke(app, ["attest", "--tdx-quote", str(TDX / "tdx_quote"), "--collateral",
                                   str(TDX / "tdx_quote_collateral.json"), "--at", str(AT), "--json"])
    doc = json.loads(out.stdout)
    assert doc["verified_at"] == "2025-06-19T11:16:03Z"
    assert doc["collateral_valid"] == {"from": "2025-06-19T10:16:03Z", "to": "2025-07-19T10:16:03Z"}


def test_an_unverified_tdx_quote_does_not_claim_a_debug_state() -> None:
    """A quote refused before its TD report was verified said "debug": false: nothing was read to say so."""
    refused = verify_tdx_quote(QUOTE, COLLATERAL, now=AT + 60 * 86400)  # expired collateral
    assert refused.failed == "quote-verified" and refused.to_json()["debug"] is None
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=AT).to_json()["debug"] is False


def test_snp_revocation_is_named_as_not_checked() -> None:
    """AMD's CRL for the ASK and VCEK is not fetched or checked: the verdict says so rather than nothing."""
    assert "AMD's CRL" in verify_snp_report(REPORT, VCEK).not_checked["cert-chain-not-revoked"]
