"""Intel TDX quotes: a real version-4 quote and its collateral (dcap-qvl's sample, MIT, tests/data/intel-tdx/)
verify with dcap-qvl against Intel's root; a changed byte, expired or not-yet-valid collateral, another root and
the policy (debug TD, TCB status, MRTD and RTMR allow-lists) refuse by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import DATA_DIR
from helpers import TDX_COLLATERAL as COLLATERAL
from helpers import TDX_QUOTE as QUOTE
from typer.testing import CliRunner

from gputravel.core.evidence.nvidia_spdm import device_root
from gputravel.core.evidence.policy import PolicyError, TdxPolicy, load_evidence_policy
from gputravel.core.evidence.tdx import apply_tdx_policy, verify_tdx_quote

DATA = DATA_DIR / "intel-tdx"
AT = 1750331763  # the TCB info's issueDate + 1 h (tests/data/intel-tdx/README.md)
MR_TD = "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"
TD_REPORT_OFFSET = 48  # the TD report follows the 48-byte quote header


def test_real_quote_verifies_up_to_date_at_the_documented_time() -> None:
    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT)
    assert verdict.ok, verdict.reason
    assert verdict.tcb_status == "UpToDate" and verdict.advisory_ids == ()
    assert verdict.mr_td == MR_TD
    assert len(verdict.rtmrs) == 4 and all(len(r) == 96 for r in verdict.rtmrs)
    assert len(verdict.report_data) == 128
    assert verdict.debug is False


@pytest.mark.parametrize("offset", [TD_REPORT_OFFSET + 16, TD_REPORT_OFFSET + 136, TD_REPORT_OFFSET + 520],
                         ids=["mr-seam", "mr-td", "report-data"])
def test_a_flipped_byte_of_the_td_report_is_refused(offset: int) -> None:
    bad = bytearray(QUOTE)
    bad[offset] ^= 0x01
    verdict = verify_tdx_quote(bytes(bad), COLLATERAL, now=AT)
    assert not verdict.ok and verdict.failed == "quote-verified"
    assert "signature" in verdict.reason


def test_expired_collateral_is_refused() -> None:
    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT + 60 * 86400)
    assert not verdict.ok and verdict.failed == "quote-verified" and "expired" in verdict.reason.lower()


def test_collateral_from_the_future_is_refused() -> None:
    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT - 7200)
    assert not verdict.ok and verdict.failed == "quote-verified" and "future" in verdict.reason


def test_another_pinned_root_refuses_intels_chain() -> None:
    from cryptography.hazmat.primitives.serialization import Encoding

    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, root_ca_der=device_root().public_bytes(Encoding.DER))
    assert not verdict.ok and verdict.failed == "quote-verified"


def test_garbage_is_refused_as_unparsed_not_raised() -> None:
    assert verify_tdx_quote(b"not a quote", COLLATERAL, now=AT).failed == "quote-parsed"
    assert verify_tdx_quote(QUOTE, b"{}", now=AT).failed == "collateral-parsed"


def _debug(verdict_attrs: str) -> str:
    raw = bytearray(bytes.fromhex(verdict_attrs))
    raw[0] |= 0x01  # TD_ATTRIBUTES.DEBUG
    return raw.hex()


def test_a_debug_td_is_refused_by_the_policy() -> None:
    good = verify_tdx_quote(QUOTE, COLLATERAL, now=AT)
    debug_td = dataclasses.replace(good, td_attributes=_debug(good.td_attributes))
    assert debug_td.debug
    refused = apply_tdx_policy(debug_td, TdxPolicy())
    assert not refused.ok and refused.failed == "td-not-debug"
    assert apply_tdx_policy(good, TdxPolicy()).ok


def test_tcb_status_outside_the_allow_list_is_refused() -> None:
    verdict = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(tcb_status=("OutOfDate",)))
    assert not verdict.ok and verdict.failed == "tcb-status"


def test_mr_td_and_rtmr_allow_lists_decide() -> None:
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(mr_td=(MR_TD,))).ok
    wrong = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(mr_td=("00" * 48,)))
    assert wrong.failed == "mr-td"
    rtmrs = ((), ("00" * 48,), (), ())
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(rtmrs=rtmrs)).failed == "rtmr1"


def test_policy_file_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[intel-tdx]\nallow_debug = true\n")  # no such key: a debug TD is never accepted
    with pytest.raises(PolicyError, match="allow_debug"):
        load_evidence_policy(bad)
    assert load_evidence_policy().tdx.tcb_status == ("UpToDate",)  # the shipped one


# --- the command ------------------------------------------------------------------------------------------------
def test_cli_prints_the_documented_json_and_exits_0() -> None:
    from gputravel.console.cli.main import app

    out = CliRunner().invoke(app, ["attest", "--tdx-quote", str(DATA / "tdx_quote"), "--collateral",
                                   str(DATA / "tdx_quote_collateral.json"), "--at", str(AT), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert {"ok", "platform", "tcb_status", "advisory_ids", "mr_td", "rtmrs", "report_data"} <= set(doc)
    assert doc["ok"] is True and doc["platform"] == "intel-tdx" and doc["tcb_status"] == "UpToDate"


def test_cli_exits_3_on_expired_collateral() -> None:
    from gputravel.console.cli.main import app

    out = CliRunner().invoke(app, ["attest", "--tdx-quote", str(DATA / "tdx_quote"), "--collateral",
                                   str(DATA / "tdx_quote_collateral.json"), "--at", str(AT + 60 * 86400)])
    assert out.exit_code == 3 and "quote-verified" in out.stderr


def test_cli_exits_2_for_a_bad_policy_file(tmp_path: Path) -> None:
    from gputravel.console.cli.main import main

    bad = tmp_path / "p.toml"
    bad.write_text("[intel-tdx]\nnope = 1\n")
    import sys

    argv = sys.argv
    sys.argv = ["gputravel", "attest", "--tdx-quote", str(DATA / "tdx_quote"), "--collateral",
                str(DATA / "tdx_quote_collateral.json"), "--policy", str(bad)]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = argv
    assert exc.value.code == 2
