"""AMD SEV-SNP: virtee/sev's real Milan report verifies with its VCEK under AMD's pinned ARK/ASK (Apache-2.0,
tests/data/amd-snp/); a flipped bit, trailing bytes, another product's roots, a VCEK of another chip or TCB and the
policy (debug guest, VMPL, minimum TCB, allow-lists) are refused by name. SIM reports (``sim_snp.SimSnp``) verify
under the SIM roots with the same verifier and never under AMD's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers import DATA_DIR
from typer.testing import CliRunner

from gputravel.core.evidence.policy import PolicyError, SnpPolicy, load_evidence_policy
from gputravel.core.evidence.sim_snp import SimSnp
from gputravel.core.evidence.snp import (
    PSS_SHA384,
    amd_roots,
    load_certificate,
    vcek_hwid,
    vcek_tcb,
    verify_snp_report,
)
from gputravel.core.evidence.snp_report import SnpFormatError, Tcb, parse_snp_report

DATA = DATA_DIR / "amd-snp"
REPORT_HEX = (DATA / "report_milan.hex").read_bytes()
REPORT = bytes.fromhex(REPORT_HEX.decode().strip())
VCEK = (DATA / "vcek_milan.der").read_bytes()
MEASUREMENT = "7a1e5c266c0108dbc9bb94fa926951320940915d0aafb42464bd88b579ea158d3e1a0dc39b2c60bd95b9c480cd81841f"
JSON_KEYS = {"ok", "platform", "measurement", "report_data", "reported_tcb", "chip_id", "policy", "checks",
             "not_checked", "failed_claim"}
# the command adds when it verified, against which VCEK's dates, and the reason of a failure
CLI_JSON_KEYS = JSON_KEYS | {"failed_reason", "verified_at", "product", "vcek"}


def test_real_milan_report_verifies_under_amds_pinned_roots() -> None:
    verdict = verify_snp_report(REPORT_HEX, VCEK)
    assert verdict.ok, verdict.reason
    doc = verdict.to_json()
    assert set(doc) == JSON_KEYS and doc["platform"] == "amd-sev-snp" and doc["measurement"] == MEASUREMENT
    assert doc["reported_tcb"] == {"boot_loader": 3, "tee": 0, "snp": 8, "microcode": 115}
    assert doc["policy"]["debug"] is False and doc["chip_id"] == (vcek_hwid(_vcek()) or b"").hex()
    assert all(doc["checks"].values()) and "report-signature-verified" in doc["checks"]


def _vcek() -> x509.Certificate:
    return load_certificate(VCEK)


def test_vcek_extensions_are_read_as_amd_defines_them() -> None:
    cert = _vcek()
    assert vcek_tcb(cert, "milan") == Tcb(boot_loader=3, tee=0, snp=8, microcode=115)
    assert vcek_hwid(cert) == parse_snp_report(REPORT).chip_id
    tcert = load_certificate((DATA / "vcek_turin.der").read_bytes())
    assert vcek_tcb(tcert, "turin") == Tcb(boot_loader=0, tee=0, snp=0, microcode=9, fmc=0)
    assert len(vcek_hwid(tcert) or b"") == 8


@pytest.mark.parametrize("product", ["milan", "genoa", "turin"])
def test_each_products_ark_signs_its_ask_with_pss(product: str) -> None:
    ark, ask = amd_roots(product)
    key = ark.public_key()
    assert isinstance(key, rsa.RSAPublicKey) and key.key_size == 4096
    key.verify(ask.signature, ask.tbs_certificate_bytes, PSS_SHA384, hashes.SHA384())
    assert ask.issuer == ark.subject and product.capitalize() in ark.subject.rfc4514_string()


def test_virtees_flipped_bit_is_refused_by_name() -> None:
    bad = bytearray(REPORT)
    bad[21] ^= 0x80  # virtee/sev's own test: bit 7 of byte 21 (the guest policy)
    verdict = verify_snp_report(bytes(bad), VCEK)
    assert not verdict.ok and verdict.failed == "report-signature-verified"


@pytest.mark.parametrize("offset", [0x50, 0x90, 0x1A0, 0x2A0], ids=["report-data", "measurement", "chip-id", "r"])
def test_a_flipped_byte_anywhere_signed_is_refused(offset: int) -> None:
    bad = bytearray(REPORT)
    bad[offset] ^= 0x01
    verdict = verify_snp_report(bytes(bad), VCEK)
    assert not verdict.ok and verdict.failed == "report-signature-verified"


@pytest.mark.parametrize("data,why", [(REPORT + b"\0", "trailing"), (REPORT[:-1], "truncated"),
                                      (REPORT + bytes(1 << 20), "trailing")])
def test_a_report_of_the_wrong_size_is_refused_at_parse(data: bytes, why: str) -> None:
    verdict = verify_snp_report(data, VCEK)
    assert not verdict.ok and verdict.failed == "report-parsed" and why in verdict.reason


def test_an_unknown_version_is_refused_at_parse() -> None:
    with pytest.raises(SnpFormatError, match="version 4"):
        parse_snp_report(b"\x04" + REPORT[1:])


def test_another_products_roots_refuse_the_milan_vcek() -> None:
    verdict = verify_snp_report(REPORT, VCEK, product="genoa")
    assert not verdict.ok and verdict.failed == "product"


def test_a_vcek_expired_at_the_given_time_is_refused() -> None:
    verdict = verify_snp_report(REPORT, VCEK, now=2_000_000_000)  # 2033; the VCEK ends 2030-04-03
    assert not verdict.ok and verdict.failed == "cert-chain-validated" and "valid" in verdict.reason


def test_a_self_made_ask_is_refused(tmp_path: Path) -> None:
    sim = SimSnp.generate()
    (tmp_path / "ask.crt").write_bytes(sim.roots_pem()[1])
    verdict = verify_snp_report(REPORT, VCEK, policy=SnpPolicy(ask=tmp_path / "ask.crt"))
    assert not verdict.ok and verdict.failed == "cert-chain-validated"


def test_the_policy_allow_lists_and_min_tcb_refuse_by_name() -> None:
    assert verify_snp_report(REPORT, VCEK, policy=SnpPolicy(measurement=(MEASUREMENT,))).ok
    for pol, claim in ((SnpPolicy(measurement=("00" * 48,)), "measurement"),
                       (SnpPolicy(host_data=("11" * 32,)), "host-data"),
                       (SnpPolicy(id_key_digest=("22" * 48,)), "id-key-digest"),
                       (SnpPolicy(min_tcb=(("microcode", 200),)), "min-tcb"),
                       (SnpPolicy(vmpl=(1,)), "vmpl")):
        verdict = verify_snp_report(REPORT, VCEK, policy=pol)
        assert not verdict.ok and verdict.failed == claim, (claim, verdict.failed)


# --- SIM ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim() -> SimSnp:
    return SimSnp.generate()


def _sim_policy(sim: SimSnp, folder: Path, **kw: object) -> SnpPolicy:
    ark, ask = sim.roots_pem()
    (folder / "sim-ark.crt").write_bytes(ark)
    (folder / "sim-ask.crt").write_bytes(ask)
    return dataclasses.replace(SnpPolicy(ark=folder / "sim-ark.crt", ask=folder / "sim-ask.crt"), **kw)


def test_sim_report_verifies_under_the_sim_roots_only(sim: SimSnp, tmp_path: Path) -> None:
    report = sim.report(b"\x07" * 64)
    verdict = verify_snp_report(report, sim.vcek_der(), policy=_sim_policy(sim, tmp_path))
    assert verdict.ok, verdict.reason
    assert verdict.to_json()["report_data"] == "07" * 64
    amd = verify_snp_report(report, sim.vcek_der())
    assert not amd.ok and amd.failed == "cert-chain-validated"


def test_sim_debug_guest_is_refused_whatever_the_policy(sim: SimSnp, tmp_path: Path) -> None:
    verdict = verify_snp_report(sim.report(b"", debug=True), sim.vcek_der(), policy=_sim_policy(sim, tmp_path))
    assert not verdict.ok and verdict.failed == "guest-not-debug"
    assert verdict.checks["report-signature-verified"] is True


def test_sim_report_at_a_lower_vmpl_than_allowed_is_refused(sim: SimSnp, tmp_path: Path) -> None:
    verdict = verify_snp_report(sim.report(b"", vmpl=2), sim.vcek_der(), policy=_sim_policy(sim, tmp_path))
    assert not verdict.ok and verdict.failed == "vmpl"
    assert verify_snp_report(sim.report(b"", vmpl=2), sim.vcek_der(),
                             policy=_sim_policy(sim, tmp_path, vmpl=(0, 2))).ok


def test_sim_report_whose_tcb_differs_from_the_vceks_is_refused(sim: SimSnp, tmp_path: Path) -> None:
    report = sim.report(b"", reported_tcb=Tcb(boot_loader=3, tee=0, snp=9, microcode=115))
    verdict = verify_snp_report(report, sim.vcek_der(), policy=_sim_policy(sim, tmp_path))
    assert not verdict.ok and verdict.failed == "tcb-match"


def test_sim_report_of_another_chip_is_refused(sim: SimSnp, tmp_path: Path) -> None:
    other = SimSnp.generate()
    verdict = verify_snp_report(other.report(b""), sim.vcek_der(), policy=_sim_policy(sim, tmp_path))
    assert not verdict.ok and verdict.failed == "report-signature-verified"


@pytest.mark.parametrize("product", ["genoa", "turin"])
def test_sim_version_3_reports_of_genoa_and_turin_verify(product: str, tmp_path: Path) -> None:
    chip = SimSnp.generate(product=product, tcb=Tcb(boot_loader=1, tee=2, snp=3, microcode=4,
                                           fmc=5 if product == "turin" else None))
    verdict = verify_snp_report(chip.report(b"x", version=3), chip.vcek_der(), policy=_sim_policy(chip, tmp_path))
    assert verdict.ok, verdict.reason
    assert verdict.to_json()["reported_tcb"]["snp"] == 3
    wrong = verify_snp_report(chip.report(b"x", version=3), chip.vcek_der(), product="milan",
                              policy=_sim_policy(chip, tmp_path))
    assert not wrong.ok and wrong.failed == "product"


# --- the policy file and the command -----------------------------------------------------------------------------
def test_amd_snp_policy_section_is_read_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    assert load_evidence_policy().snp.vmpl == (0,)
    good = tmp_path / "p.toml"
    good.write_text('[amd-snp]\nmin_tcb = {snp = 8, microcode = 115}\nmeasurement = ["AB"]\n')
    pol = load_evidence_policy(good).snp
    assert dict(pol.min_tcb) == {"snp": 8, "microcode": 115} and pol.measurement == ("ab",)
    for bad in ('[amd-snp]\nallow_debug = true\n', '[amd-snp]\nmin_tcb = {sn = 1}\n', '[amd-snp]\nvmpl = [4]\n'):
        good.write_text(bad)
        with pytest.raises(PolicyError):
            load_evidence_policy(good)


def test_cli_prints_exactly_the_documented_json_and_exits_0() -> None:
    from gputravel.console.cli.main import app

    out = CliRunner().invoke(app, ["attest", "--snp-report", str(DATA / "report_milan.hex"), "--vcek",
                                   str(DATA / "vcek_milan.der"), "--product", "milan", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert set(doc) == CLI_JSON_KEYS and doc["ok"] is True and doc["failed_claim"] is None


def test_cli_exits_3_naming_the_claim_for_a_flipped_bit(tmp_path: Path) -> None:
    from gputravel.console.cli.main import app

    bad = bytearray(REPORT)
    bad[21] ^= 0x80
    (tmp_path / "r.bin").write_bytes(bytes(bad))
    out = CliRunner().invoke(app, ["attest", "--snp-report", str(tmp_path / "r.bin"), "--vcek",
                                   str(DATA / "vcek_milan.der"), "--json"])
    assert out.exit_code == 3
    assert json.loads(out.stdout)["failed_claim"] == "report-signature-verified"
    assert "report-signature-verified" in out.stderr


@pytest.mark.parametrize("args", [["--product", "rome"], [], ["--vcek-missing"]])
def test_cli_exits_2_for_bad_input(args: list[str], tmp_path: Path) -> None:
    from gputravel.console.cli.main import app

    base = ["attest", "--snp-report", str(DATA / "report_milan.hex")]
    if args == ["--vcek-missing"]:
        argv = base
    elif args:
        argv = base + ["--vcek", str(DATA / "vcek_milan.der")] + args
    else:
        huge = tmp_path / "huge.hex"
        huge.write_bytes(b"00" * (5 * 1024 * 1024))  # 10 MB of hex: over the cap, refused before decoding
        argv = ["attest", "--snp-report", str(huge), "--vcek", str(DATA / "vcek_milan.der")]
    out = CliRunner().invoke(app, argv)
    assert out.exit_code == 2, out.output
