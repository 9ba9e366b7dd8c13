"""NVIDIA GPU evidence on NVIDIA's own sample (from the pinned nv-local-gpu-verifier wheel, fetched once into the
download cache with ``pip download --no-deps``, never installed): it verifies, and each single change is refused
by the claim NVIDIA's verifier would name."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from evidence_samples import (  # noqa: F401 (the *_fixture names are pytest fixtures)
    RIM_VALID_AT,
    SAMPLE_NONCE,
    NvidiaSample,
    make_rim_signer,
    nv_wheel_fixture,
    resign_rim,
    sample_fixture,
)
from helpers import DATA_DIR
from typer.testing import CliRunner

from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.nvidia_rim import rim_root, verify_rim
from gputravel.core.evidence.nvidia_spdm import device_root, parse_report, read_hex_or_raw
from gputravel.core.evidence.policy import GpuPolicy

REPORT_ONLY = GpuPolicy(require_rims=False)
P = "x-nvidia-gpu-attestation-report"
DATA = DATA_DIR


def _pems(chain: bytes) -> list[bytes]:
    return re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n?", chain, re.S)


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x01
    return bytes(out)


def test_shipped_roots_are_the_ones_nvidia_ships(sample: NvidiaSample) -> None:
    assert device_root() == x509.load_pem_x509_certificate(sample.device_root_pem)
    assert rim_root() == x509.load_pem_x509_certificate(sample.rim_root_pem)


def test_sample_parses_into_64_sha384_blocks_and_the_documented_facts(sample: NvidiaSample) -> None:
    raw = read_hex_or_raw(sample.report)
    assert len(raw) == 4117
    report = parse_report(raw)
    assert report.nonce == SAMPLE_NONCE
    assert sorted(report.blocks) == list(range(1, 65))
    assert {len(b.value) for b in report.blocks.values()} == {48}
    assert report.driver_version == "550.90.07"
    assert report.vbios_version == "96.00.9f.00.01"
    assert len(report.signature) == 96 and report.signed == raw[:-96]


def test_nvidia_sample_verifies_on_signature_chain_fwid_and_nonce(sample: NvidiaSample) -> None:
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE, policy=REPORT_ONLY)
    values = verdict.claims.values()
    assert verdict.ok, verdict.failed
    for name in ("parsed", "cert-chain-fwid-match", "nonce-match", "signature-verified"):
        assert values[f"{P}-{name}"] is True, name
    chain = values[f"{P}-cert-chain"]  # claims 3.0: one nested claim for the chain
    assert chain["x-nvidia-cert-status"] == "valid" and chain["x-nvidia-cert-revocation-reason"] is None
    assert chain["x-nvidia-cert-ocsp-status"] == "not-checked"  # offline: the policy accepts it
    assert values["x-nvidia-gpu-arch-check"] is True
    assert values["x-nvidia-gpu-driver-version"] == "550.90.07"
    assert values["x-nvidia-gpu-vbios-version"] == "96.00.9F.00.01"  # NVIDIA's case
    assert values["hwmodel"] == "GH100 A01 GSP BROM"
    assert values["measres"] == "not-checked"
    assert "secboot" not in values and "dbgstat" not in values  # NVIDIA sets them only when measres succeeds
    assert values["x-nvidia-overall-att-result"] is True


def test_the_shipped_policy_refuses_a_report_without_rims_naming_measres(sample: NvidiaSample) -> None:
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE)
    assert not verdict.ok
    assert verdict.failed is not None and verdict.failed.name == "measres"
    assert verdict.claims.values()["x-nvidia-overall-att-result"] is False


def test_ocsp_not_checked_is_refused_when_the_policy_does_not_accept_it(sample: NvidiaSample) -> None:
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE,
                         policy=GpuPolicy(require_rims=False, accept_ocsp_not_checked=False))
    assert verdict.failed is not None and verdict.failed.name == f"{P}-cert-chain"


def _changed(sample: NvidiaSample, change: str) -> tuple[bytes, bytes, bytes]:
    raw = read_hex_or_raw(sample.report)
    chain, nonce = sample.chain, SAMPLE_NONCE
    if change == "nonce":
        nonce = _flip(SAMPLE_NONCE, 0)
    elif change == "nonce-in-report":
        raw = _flip(raw, 4)
    elif change == "measurement-byte":
        raw = _flip(raw, 37 + 8 + 7 + 10)  # a byte inside block 1's SHA-384 value
    elif change == "fwid-in-report":
        raw = raw.replace(bytes.fromhex("f5c384aebb579217"), bytes.fromhex("f5c384aebb579218"))
    elif change == "signature":
        raw = _flip(raw, len(raw) - 1)
    elif change in ("leaf-certificate", "intermediate-certificate", "root-certificate"):
        pems = _pems(sample.chain)
        pos = {"leaf-certificate": 0, "intermediate-certificate": 2, "root-certificate": 4}[change]
        der = x509.load_pem_x509_certificate(pems[pos]).public_bytes(Encoding.DER)
        bad = x509.load_der_x509_certificate(_flip(der, len(der) - 3))  # inside the certificate's signature
        pems[pos] = bad.public_bytes(Encoding.PEM)
        chain = b"".join(pems)
    elif change == "chain-of-four":
        chain = b"".join(_pems(sample.chain)[:4])
    elif change == "truncated":
        raw = raw[:-100]
    return raw, chain, nonce


@pytest.mark.parametrize(("change", "claim"), [
    ("nonce", f"{P}-nonce-match"),
    ("nonce-in-report", f"{P}-nonce-match"),
    ("measurement-byte", f"{P}-signature-verified"),
    ("fwid-in-report", f"{P}-cert-chain-fwid-match"),
    ("signature", f"{P}-signature-verified"),
    ("leaf-certificate", f"{P}-cert-chain"),
    ("intermediate-certificate", f"{P}-cert-chain"),
    ("root-certificate", f"{P}-cert-chain"),
    ("chain-of-four", f"{P}-cert-chain"),
    ("truncated", f"{P}-parsed"),
])
def test_each_single_change_to_the_sample_is_refused_by_name(sample: NvidiaSample, change: str, claim: str) -> None:
    raw, chain, nonce = _changed(sample, change)
    verdict = verify_gpu(raw, chain, nonce, policy=REPORT_ONLY)
    assert not verdict.ok
    assert verdict.failed is not None and verdict.failed.name == claim
    assert verdict.claims.values()["x-nvidia-overall-att-result"] is False


def test_a_measurement_byte_change_also_breaks_only_the_signature_not_the_parse(sample: NvidiaSample) -> None:
    raw, chain, nonce = _changed(sample, "measurement-byte")
    values = verify_gpu(raw, chain, nonce, policy=REPORT_ONLY).claims.values()
    assert values[f"{P}-parsed"] is True and values[f"{P}-nonce-match"] is True
    assert values[f"{P}-signature-verified"] is False


def test_nvidias_sample_rims_are_genuine_but_for_other_versions_and_the_verdict_says_so(
        sample: NvidiaSample) -> None:
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE, rims=[sample.driver_rim, sample.vbios_rim],
                         at=RIM_VALID_AT)
    values = verdict.claims.values()
    for kind in ("driver", "vbios"):
        assert values[f"x-nvidia-gpu-{kind}-rim-schema-validated"] is True
        assert values[f"x-nvidia-gpu-{kind}-rim-cert-chain"]["x-nvidia-cert-status"] == "valid"
        assert values[f"x-nvidia-gpu-{kind}-rim-signature-verified"] is True
        assert values[f"x-nvidia-gpu-{kind}-rim-version-match"] is False
    assert "545.00" in verdict.claims["x-nvidia-gpu-driver-rim-version-match"].detail
    assert values["measres"] == "fail"  # the 545.00 / 96.00.5E RIMs do not describe a 550.90.07 / 96.00.9f GPU
    assert not verdict.ok and verdict.failed is not None
    assert verdict.failed.name == "x-nvidia-gpu-driver-rim-version-match"


def test_nvidias_rim_chain_has_expired_by_now_and_the_claim_says_when(sample: NvidiaSample) -> None:
    claims, rim = verify_rim(sample.vbios_rim, expected_version="96.00.5E.00.01",
                             at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert rim is None
    assert claims["x-nvidia-gpu-vbios-rim-cert-chain"].ok is False
    assert claims["x-nvidia-gpu-vbios-rim-cert-chain"].value["x-nvidia-cert-status"] == "expired"
    assert "not valid at" in claims["x-nvidia-gpu-vbios-rim-cert-chain"].detail
    assert claims["x-nvidia-gpu-vbios-rim-signature-verified"].ok is True  # the signature itself still holds


def test_a_changed_golden_value_in_a_signed_rim_fails_its_signature(sample: NvidiaSample) -> None:
    text = sample.vbios_rim.decode()
    golden = re.search(r'index="1" active="True" alternatives="1" ns2:Hash0="([0-9a-f]{96})"', text)
    assert golden is not None
    forged = text.replace(golden.group(1), "00" * 48).encode()
    claims, rim = verify_rim(forged, expected_version="96.00.5E.00.01", at=RIM_VALID_AT)
    assert rim is None
    assert claims["x-nvidia-gpu-vbios-rim-signature-verified"].ok is False


def test_a_rim_not_under_the_pinned_root_fails_its_chain(sample: NvidiaSample) -> None:
    signer = make_rim_signer()
    resigned = resign_rim(sample.vbios_rim, signer, version="96.00.9f.00.01", values={})
    claims, rim = verify_rim(resigned, expected_version="96.00.9f.00.01")  # NVIDIA's root pinned
    assert rim is None and claims["x-nvidia-gpu-vbios-rim-cert-chain"].ok is False


def _golden_pair(sample: NvidiaSample, signer: object, vbios_values: dict[int, list[bytes]]) -> list[bytes]:
    """NVIDIA's RIMs re-signed under a test root, with the sample report's versions and measurements."""
    report = parse_report(read_hex_or_raw(sample.report))
    driver_idx = [int(i) for i in re.findall(r'index="(\d+)" active="True"', sample.driver_rim.decode())]
    vbios_idx = [int(i) for i in re.findall(r'index="(\d+)" active="True"', sample.vbios_rim.decode())]

    def actual(idx: list[int]) -> dict[int, list[bytes]]:
        return {i: [report.measurement(i) or b""] for i in idx}

    return [
        resign_rim(sample.driver_rim, signer, version=report.driver_version, values=actual(driver_idx)),  # type: ignore[arg-type]
        resign_rim(sample.vbios_rim, signer, version=report.vbios_version.upper(),  # type: ignore[arg-type]
                   values={**actual(vbios_idx), **vbios_values}),
    ]


def test_measurements_match_rims_with_the_reports_values_and_alternatives_are_allowed(
        sample: NvidiaSample) -> None:
    signer = make_rim_signer()
    report = parse_report(read_hex_or_raw(sample.report))
    # index 1 lists a wrong value first and the GPU's value as the second alternative
    rims = _golden_pair(sample, signer, {1: [b"\x11" * 48, report.measurement(1) or b""]})
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE, rims=rims, rim_root=signer.root)
    values = verdict.claims.values()
    assert verdict.ok, verdict.failed
    assert values["measres"] == "success" and values["secboot"] is True and values["dbgstat"] == "disabled"
    assert values["x-nvidia-gpu-driver-rim-version-match"] is True
    assert values["x-nvidia-gpu-vbios-rim-version-match"] is True


def test_one_golden_value_off_fails_measres_naming_the_index(sample: NvidiaSample) -> None:
    signer = make_rim_signer()
    rims = _golden_pair(sample, signer, {2: [b"\x22" * 48]})
    verdict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE, rims=rims, rim_root=signer.root)
    assert verdict.failed is not None and verdict.failed.name == "measres"
    assert "[2]" in verdict.failed.detail


# --- the command ------------------------------------------------------------------------------------------------
def _files(tmp_path: Path, sample: NvidiaSample, *, raw: bool = False) -> tuple[Path, Path]:
    report = tmp_path / ("report.bin" if raw else "report.txt")
    report.write_bytes(read_hex_or_raw(sample.report) if raw else sample.report)
    chain = tmp_path / "chain.pem"
    chain.write_bytes(sample.chain)
    return report, chain


@pytest.mark.parametrize("raw", [False, True], ids=["hex-text", "raw-bytes"])
def test_cli_verifies_the_sample_as_json_exit_0(tmp_path: Path, sample: NvidiaSample, raw: bool) -> None:
    from gputravel.console.cli.main import app

    report, chain = _files(tmp_path, sample, raw=raw)
    out = CliRunner().invoke(app, ["attest", "--evidence", str(report), "--cert-chain", str(chain),
                                   "--nonce", SAMPLE_NONCE.hex(), "--policy", str(DATA / "nvidia-gpu" /
                                                                                  "report-only.toml"), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and doc["platform"] == "nvidia-gpu"
    assert doc["claims"][f"{P}-signature-verified"] is True


def test_cli_exits_3_naming_the_nonce_claim_for_another_nonce(tmp_path: Path, sample: NvidiaSample) -> None:
    from gputravel.console.cli.main import app

    report, chain = _files(tmp_path, sample)
    out = CliRunner().invoke(app, ["attest", "--evidence", str(report), "--cert-chain", str(chain),
                                   "--nonce", "00" * 32, "--policy", str(DATA / "nvidia-gpu" / "report-only.toml"),
                                   "--json"])
    assert out.exit_code == 3
    assert json.loads(out.stdout)["failed_claim"] == f"{P}-nonce-match"
    assert f"{P}-nonce-match" in out.stderr


def test_cli_with_the_shipped_policy_and_no_rims_exits_3_naming_measres(tmp_path: Path,
                                                                        sample: NvidiaSample) -> None:
    from gputravel.console.cli.main import app

    report, chain = _files(tmp_path, sample)
    out = CliRunner().invoke(app, ["attest", "--evidence", str(report), "--cert-chain", str(chain),
                                   "--nonce", SAMPLE_NONCE.hex()])
    assert out.exit_code == 3 and "measres" in out.stderr


def test_cli_refuses_a_malformed_nonce_as_a_data_error(tmp_path: Path, sample: NvidiaSample) -> None:
    from gputravel.console.cli.main import app

    report, chain = _files(tmp_path, sample)
    out = CliRunner().invoke(app, ["attest", "--evidence", str(report), "--cert-chain", str(chain),
                                   "--nonce", "abc"])
    assert out.exit_code == 2  # bad input, not an attestation verdict
    assert "--nonce" in out.output


def test_pem_chain_given_as_hex_text_reads_the_same(sample: NvidiaSample) -> None:
    hexed = base64.b16encode(sample.chain)
    verdict = verify_gpu(sample.report, hexed, SAMPLE_NONCE, policy=REPORT_ONLY)
    assert verdict.ok


def test_a_waived_check_says_which_policy_key_waived_it_and_a_required_one_what_to_do(sample: NvidiaSample) -> None:
    """Auditor walk, session 15: offline, the chain's revocation is not checked; under the shipped policy the
    verdict passed without saying that the policy waived it, and under a policy that requires it the refusal did
    not say how to check it (--ocsp-url) or waive it."""
    waived = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE, policy=REPORT_ONLY)
    chain = waived.claims[f"{P}-cert-chain"]
    assert waived.ok and chain.ok is None and "accept_ocsp_not_checked = true" in chain.detail
    assert "require_rims = false" in waived.claims["measres"].detail
    strict = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE,
                        policy=GpuPolicy(require_rims=False, accept_ocsp_not_checked=False))
    assert not strict.ok and strict.failed is not None and strict.failed.name == f"{P}-cert-chain"
    assert "--ocsp-url" in strict.failed.detail and "accept_ocsp_not_checked" in strict.failed.detail
    rims = verify_gpu(sample.report, sample.chain, SAMPLE_NONCE)  # the shipped policy, no RIM given
    assert rims.failed is not None and rims.failed.name == "measres"
    assert "--rim" in rims.failed.detail and "require_rims = false" in rims.failed.detail
