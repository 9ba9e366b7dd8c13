"""Policy keys the session-15 auditor could not express (task policy16 item 2), each passing at the right value,
refused by name at the wrong one with what to do, and named in ``not_checked`` when unset:

* ``[amd-snp] allow_smt`` / ``allow_migration_agent``: guest policy bits 16 and 18 (claims ``guest-no-smt``,
  ``guest-no-migration-agent``); virtee's Milan report allows SMT and no migration agent;
* ``[intel-tdx] min_tee_tcb_svn`` (byte by byte over the 16 bytes, claim ``tee-tcb-svn``) and
  ``max_collateral_age_days`` (days since the TCB info's issueDate at the verification time, ``--at`` included,
  claim ``collateral-age``), on dcap-qvl's quote and collateral.

Real evidence from tests/data; SIM reports (``sim_snp.SimSnp``, signed under SIM roots) where a bit must be set
that the real report does not have (its signature cannot be remade)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from helpers import DATA_DIR
from helpers import MILAN_REPORT as REPORT
from helpers import MILAN_VCEK as VCEK
from helpers import TDX_COLLATERAL as COLLATERAL
from helpers import TDX_QUOTE as QUOTE
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.core.evidence.cvm_snp import check_snp_cvm, snp_collateral
from gputravel.core.evidence.holder_check import HolderVerifier
from gputravel.core.evidence.policy import (
    EvidencePolicy,
    PolicyError,
    SnpPolicy,
    TdxPolicy,
    load_evidence_policy,
)
from gputravel.core.evidence.sim_snp import SimSnp
from gputravel.core.evidence.snp import verify_snp_report
from gputravel.core.evidence.tdx import verify_tdx_quote

SNP = DATA_DIR / "amd-snp"
TDX = DATA_DIR / "intel-tdx"
ISSUED = 1750328163  # the TCB info's issueDate, 2025-06-19T10:16:03Z
AT = ISSUED + 3600
DAY = 86400
SVN = "06010300000000000000000000000000"  # the sample's TEE_TCB_SVN
runner = CliRunner()


# --- SEV-SNP guest policy: SMT (bit 16) and a migration agent (bit 18) -----------------------------------------
def test_smt_is_refused_when_the_policy_disallows_it_and_named_otherwise() -> None:
    plain = verify_snp_report(REPORT, VCEK).report
    assert plain is not None and plain.policy_json()["smt"] is True
    refused = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(allow_smt=False))
    assert not refused.ok and refused.failed == "guest-no-smt"
    assert "bit 16" in refused.reason and "allow_smt = true" in refused.reason and "SMT disallowed" in refused.reason
    allowed = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(allow_smt=True))
    assert allowed.ok and "= true" in allowed.not_checked["guest-no-smt"] and "guest-no-smt" not in allowed.checks
    unset = verify_snp_report(REPORT, VCEK)
    assert unset.ok and "does not set allow_smt" in unset.not_checked["guest-no-smt"]


def test_a_migration_agent_is_refused_when_the_policy_disallows_it(tmp_path: Path) -> None:
    real = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(allow_migration_agent=False))
    assert real.ok and real.checks["guest-no-migration-agent"] is True  # the Milan report allows none
    assert "does not set allow_migration_agent" in verify_snp_report(REPORT, VCEK).not_checked[
        "guest-no-migration-agent"]
    sim = SimSnp.generate()
    ark, ask = sim.roots_pem()
    (tmp_path / "ark.crt").write_bytes(ark)
    (tmp_path / "ask.crt").write_bytes(ask)
    roots = SnpPolicy(ark=tmp_path / "ark.crt", ask=tmp_path / "ask.crt")
    with_ma = sim.report(b"", migration_agent=True)
    refused = verify_snp_report(with_ma, sim.vcek_der(), policy=dataclasses.replace(roots, allow_migration_agent=False))
    assert not refused.ok and refused.failed == "guest-no-migration-agent"
    assert "bit 18" in refused.reason and "allow_migration_agent = true" in refused.reason
    assert verify_snp_report(with_ma, sim.vcek_der(), policy=dataclasses.replace(roots, allow_migration_agent=True)).ok
    no_smt = verify_snp_report(sim.report(b"", smt=False), sim.vcek_der(),
                               policy=dataclasses.replace(roots, allow_smt=False))
    assert no_smt.ok and no_smt.checks["guest-no-smt"] is True
    # the holder's check of an SNP orchestrator CVM reads the same keys from the holder's policy
    bound = sim.report(b"\x01" * 64)
    collateral = snp_collateral("snp", sim.vcek.public_bytes(Encoding.PEM))
    assert check_snp_cvm(bound, collateral, b"\x01" * 64, roots)["ok"]
    held = check_snp_cvm(bound, collateral, b"\x01" * 64, dataclasses.replace(roots, allow_smt=False))
    assert held["ok"] is False and held["failed"] == "guest-no-smt"


# --- TDX: a minimum TEE TCB SVN, component by component ---------------------------------------------------------
def test_min_tee_tcb_svn_is_compared_byte_by_byte() -> None:
    base = verify_tdx_quote(QUOTE, COLLATERAL, now=AT)
    assert base.ok and base.tee_tcb_svn == SVN and base.to_json()["tee_tcb_svn"] == SVN
    assert "does not set min_tee_tcb_svn" in base.not_checked["tee-tcb-svn"]
    equal = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(min_tee_tcb_svn=SVN))
    assert equal.ok and equal.checks["tee-tcb-svn"] is True and "tee-tcb-svn" not in equal.not_checked
    lower = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(min_tee_tcb_svn="05" + "00" * 15))
    assert lower.ok
    # byte 1 wants 2: refused, though byte 0 (6) is above what a byte-string comparison would weigh first
    refused = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(min_tee_tcb_svn="010203" + "00" * 13))
    assert not refused.ok and refused.failed == "tee-tcb-svn"
    assert "byte 1: 1 < 2" in refused.reason and "TDX module must be updated" in refused.reason


# --- TDX: the collateral's age at the verification time ---------------------------------------------------------
def test_max_collateral_age_counts_from_the_tcb_infos_issue_date() -> None:
    fresh = verify_tdx_quote(QUOTE, COLLATERAL, now=AT, policy=TdxPolicy(max_collateral_age_days=1))
    assert fresh.ok and fresh.checks["collateral-age"] is True and fresh.age_limit == ISSUED + DAY
    assert "does not set max_collateral_age_days" in verify_tdx_quote(QUOTE, COLLATERAL, now=AT).not_checked[
        "collateral-age"]
    later = AT + 2 * DAY  # inside the collateral's own window (to 2025-07-19), over the policy's one day
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=later).ok
    old = verify_tdx_quote(QUOTE, COLLATERAL, now=later, policy=TdxPolicy(max_collateral_age_days=1))
    assert not old.ok and old.failed == "collateral-age"
    assert "2025-06-19 10:16" in old.reason and "2.0 days" in old.reason and "fetch fresh collateral" in old.reason
    assert verify_tdx_quote(QUOTE, COLLATERAL, now=later, policy=TdxPolicy(max_collateral_age_days=3)).ok


def test_cli_at_moves_the_age_and_the_refusal_names_the_claim(tmp_path: Path) -> None:
    policy = tmp_path / "aged.toml"
    policy.write_text('[intel-tdx]\nmax_collateral_age_days = 1\nmin_tee_tcb_svn = "' + SVN + '"\n')
    base = ["attest", "--tdx-quote", str(TDX / "tdx_quote"), "--collateral", str(TDX / "tdx_quote_collateral.json"),
            "--policy", str(policy), "--json"]
    ok = runner.invoke(app, [*base, "--at", str(AT)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["checks"]["collateral-age"] is True
    old = runner.invoke(app, [*base, "--at", str(AT + 2 * DAY)])
    doc = json.loads(old.stdout)
    assert old.exit_code == 3 and doc["failed_claim"] == "collateral-age"
    assert "attestation failed: collateral-age" in old.stderr


def test_the_holders_cached_verdict_does_not_outlive_the_age_limit() -> None:
    """A holder keeps a passed quote's verdict until its collateral expires; under max_collateral_age_days it must
    not keep it past the limit (the same quote, two days on, inside the collateral's window)."""
    report_data = bytes.fromhex(verify_tdx_quote(QUOTE, COLLATERAL, now=AT).report_data)
    holder = HolderVerifier(EvidencePolicy(tdx=TdxPolicy(max_collateral_age_days=1)), {})
    assert holder.check_cvm(QUOTE, COLLATERAL, report_data, now=AT)["ok"]
    later = holder.check_cvm(QUOTE, COLLATERAL, report_data, now=AT + 2 * DAY)
    assert later["ok"] is False and later["failed"] == "collateral-age"


# --- the policy file --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "words"), [
    ('[intel-tdx]\nmin_tee_tcb_svn = "0601"\n', "32 hex digits"),
    ('[intel-tdx]\nmin_tee_tcb_svn = "' + "zz" * 16 + '"\n', "32 hex digits"),
    ("[intel-tdx]\nmax_collateral_age_days = -1\n", "whole number of days"),
    ("[intel-tdx]\nmax_collateral_age_days = true\n", "whole number of days"),
    ('[amd-snp]\nallow_smt = "no"\n', "allow_smt must be true or false"),
    ("[amd-snp]\nallow_migration = false\n", "unknown key"),
])
def test_bad_values_of_the_new_keys_are_refused_by_name(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=words):
        load_evidence_policy(path)


def test_the_new_keys_parse(tmp_path: Path) -> None:
    doc = ('[intel-tdx]\nmin_tee_tcb_svn = "' + SVN.upper() + '"\nmax_collateral_age_days = 7\n'
           "[amd-snp]\nallow_smt = false\nallow_migration_agent = true\n")
    (tmp_path / "p.toml").write_text(doc)
    policy = load_evidence_policy(tmp_path / "p.toml")
    assert policy.tdx.min_tee_tcb_svn == SVN and policy.tdx.max_collateral_age_days == 7
    assert policy.snp.allow_smt is False and policy.snp.allow_migration_agent is True
