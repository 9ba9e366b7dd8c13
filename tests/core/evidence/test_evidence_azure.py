"""Azure's SEV-SNP CVMs: azure-cvm-tooling's real HCL report binds its runtime data (report_data = SHA-256 of the
JSON with HCLAkPub) and its real TPM2 quote verifies with its attestation key over the nonce ``challenge`` (MIT,
tests/data/azure-vtpm/). The samples come from different VMs (README there), so the whole form is verified end to
end with a SIM Azure VM (``sim_snp.SimAzureVm``) under SIM roots; each single change is refused by name."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from helpers import DATA_DIR
from typer.testing import CliRunner

from gputravel.core.evidence.azure_snp import (
    AzureFormatError,
    ak_from_pem,
    parse_hcl_report,
    parse_tpm_quote,
    verify_azure_snp,
    verify_tpm_quote,
)
from gputravel.core.evidence.policy import SnpPolicy
from gputravel.core.evidence.sim_snp import SimAzureVm

DATA = DATA_DIR / "azure-vtpm"
HCL = (DATA / "hcl-report-snp.bin").read_bytes()
QUOTE = (DATA / "quote.bin").read_bytes()
AKPUB = (DATA / "akpub.pub").read_bytes()
CERTS = (DATA / "certs.crt").read_bytes()
NONCE = b"challenge"


def test_real_hcl_report_binds_its_runtime_data_and_names_the_vtpm_key() -> None:
    hcl = parse_hcl_report(HCL)
    assert hcl.hash_type == 1 and len(hcl.snp_report) == 1184
    assert hcl.snp_report[0x50:0x70] == hashlib.sha256(hcl.runtime_data).digest()
    assert hcl.snp_report[0x70:0x90] == bytes(32)
    assert json.loads(hcl.runtime_data)["keys"][0]["kid"] == "HCLAkPub"
    assert hcl.ak_public().key_size == 2048


def test_real_quote_verifies_with_its_key_and_nonce() -> None:
    quote = parse_tpm_quote(QUOTE)
    assert quote.extra_data == NONCE and len(quote.pcrs) == 24
    assert verify_tpm_quote(quote, ak_from_pem(AKPUB), NONCE) == ("", "")
    claim, _ = verify_tpm_quote(quote, ak_from_pem(AKPUB), b"another")
    assert claim == "tpm-nonce-match"


def test_real_quote_with_a_changed_byte_or_pcr_is_refused() -> None:
    bad = bytearray(QUOTE)
    bad[8 + 256 + 8 + 40] ^= 1  # inside TPMS_ATTEST (the clock info)
    assert verify_tpm_quote(parse_tpm_quote(bytes(bad)), ak_from_pem(AKPUB), NONCE)[0] == "tpm-quote-verified"
    bad = bytearray(QUOTE)
    bad[-1] ^= 1  # the last PCR value
    assert verify_tpm_quote(parse_tpm_quote(bytes(bad)), ak_from_pem(AKPUB), NONCE)[0] == "pcr-digest-match"


def test_real_quote_with_trailing_bytes_is_refused() -> None:
    with pytest.raises(AzureFormatError, match="trailing"):
        parse_tpm_quote(QUOTE + b"\0" * 32)


def test_the_real_hcl_reports_key_did_not_sign_the_real_quote() -> None:
    # the README's fact: the samples come from different VMs
    claim, _ = verify_tpm_quote(parse_tpm_quote(QUOTE), parse_hcl_report(HCL).ak_public(), NONCE)
    assert claim == "tpm-quote-verified"


def test_real_hcl_report_binds_then_fails_on_another_chips_vcek() -> None:
    verdict = verify_azure_snp(HCL, CERTS, QUOTE, NONCE)
    assert verdict.platform == "azure-sev-snp"
    assert verdict.checks["runtime-data-bound"] and verdict.checks["cert-chain-validated"]
    assert not verdict.ok and verdict.failed == "report-signature-verified"


def test_a_changed_runtime_data_byte_breaks_the_binding() -> None:
    bad = bytearray(HCL)
    start = HCL.index(b'"vm-configuration"')
    bad[start + 1] ^= 0x20
    verdict = verify_azure_snp(bytes(bad), CERTS, QUOTE, NONCE)
    assert not verdict.ok and verdict.failed == "runtime-data-bound"


@pytest.mark.parametrize("change", ["magic", "tail", "type"])
def test_a_malformed_hcl_report_is_refused(change: str) -> None:
    bad = bytearray(HCL)
    if change == "magic":
        bad[0] = ord("X")
    elif change == "tail":
        bad[-1] = 1
    else:
        struct.pack_into("<I", bad, 32 + 1184 + 8, 4)  # report type 4 (TDX)
    verdict = verify_azure_snp(bytes(bad), CERTS, QUOTE, NONCE)
    assert not verdict.ok and verdict.failed == "hcl-report-parsed"


# --- SIM: the whole form -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vm() -> SimAzureVm:
    return SimAzureVm.generate()


def _policy(vm: SimAzureVm, folder: Path) -> SnpPolicy:
    ark, ask = vm.chip.roots_pem()
    (folder / "ark.crt").write_bytes(ark)
    (folder / "ask.crt").write_bytes(ask)
    return SnpPolicy(ark=folder / "ark.crt", ask=folder / "ask.crt")


def test_sim_azure_vm_verifies_end_to_end(vm: SimAzureVm, tmp_path: Path) -> None:
    nonce = b"\x42" * 32
    verdict = verify_azure_snp(vm.hcl_report(), vm.chip.vcek_der(), vm.quote(nonce), nonce,
                               policy=_policy(vm, tmp_path))
    assert verdict.ok, verdict.reason
    assert {"runtime-data-bound", "tpm-quote-verified", "tpm-nonce-match", "pcr-digest-match"} <= set(verdict.checks)


def test_sim_azure_vm_refuses_a_stale_nonce_and_a_debug_guest(vm: SimAzureVm, tmp_path: Path) -> None:
    pol = _policy(vm, tmp_path)
    stale = verify_azure_snp(vm.hcl_report(), vm.chip.vcek_der(), vm.quote(b"old"), b"new", policy=pol)
    assert not stale.ok and stale.failed == "tpm-nonce-match"
    debug = verify_azure_snp(vm.hcl_report(debug=True), vm.chip.vcek_der(), vm.quote(b"n"), b"n", policy=pol)
    assert not debug.ok and debug.failed == "guest-not-debug"
    other = SimAzureVm.generate(chip=vm.chip)  # same chip, another vTPM key: its quote is not by this report's key
    swapped = verify_azure_snp(vm.hcl_report(), vm.chip.vcek_der(), other.quote(b"n"), b"n", policy=pol)
    assert not swapped.ok and swapped.failed == "tpm-quote-verified"


def test_cli_azure_form_exits_0_for_sim_and_3_for_the_real_mixed_samples(vm: SimAzureVm, tmp_path: Path) -> None:
    from gputravel.console.cli.main import app

    pol = _policy(vm, tmp_path)
    (tmp_path / "p.toml").write_text(f'[amd-snp]\nark = "{pol.ark}"\nask = "{pol.ask}"\n')
    (tmp_path / "hcl.bin").write_bytes(vm.hcl_report())
    (tmp_path / "vcek.der").write_bytes(vm.chip.vcek_der())
    (tmp_path / "quote.bin").write_bytes(vm.quote(b"\x01\x02"))
    out = CliRunner().invoke(app, ["attest", "--azure-hcl", str(tmp_path / "hcl.bin"), "--vcek",
                                   str(tmp_path / "vcek.der"), "--tpm-quote", str(tmp_path / "quote.bin"),
                                   "--nonce", "0102", "--policy", str(tmp_path / "p.toml"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["platform"] == "azure-sev-snp"
    out = CliRunner().invoke(app, ["attest", "--azure-hcl", str(DATA / "hcl-report-snp.bin"), "--vcek",
                                   str(DATA / "certs.crt"), "--tpm-quote", str(DATA / "quote.bin"),
                                   "--nonce", NONCE.hex()])
    assert out.exit_code == 3 and "report-signature-verified" in out.stderr
    out = CliRunner().invoke(app, ["attest", "--azure-hcl", str(DATA / "hcl-report-snp.bin"), "--vcek",
                                   str(DATA / "certs.crt")])
    assert out.exit_code == 2
