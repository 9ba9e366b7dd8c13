"""SIM evidence in the vendors' formats: one verifier for real and SIM evidence, only the pinned roots differ."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from typer.testing import CliRunner

from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.policy import GpuPolicy, TdxPolicy, load_evidence_policy
from gputravel.core.evidence.sim_gpu import SimGpu
from gputravel.core.evidence.sim_tdx import SimTdx
from gputravel.core.evidence.tdx import verify_tdx_quote

P = "x-nvidia-gpu-attestation-report"


@pytest.fixture(scope="module")
def sim_gpu() -> SimGpu:
    return SimGpu.generate()


def test_sim_gpu_evidence_verifies_under_the_sim_roots_with_its_sim_rims(sim_gpu: SimGpu) -> None:
    nonce = os.urandom(32)
    verdict = verify_gpu(sim_gpu.report(nonce), sim_gpu.cert_chain_pem(), nonce, rims=list(sim_gpu.rims()),
                         device_root=sim_gpu.pki.device_root, rim_root=sim_gpu.pki.rim_root)
    values = verdict.claims.values()
    assert verdict.ok, verdict.failed
    assert values["measres"] == "success" and values["secboot"] is True
    assert values["x-nvidia-gpu-driver-version"].endswith("-SIM")  # SIM stays labelled SIM
    assert "SIM" in values["hwmodel"]


def test_sim_gpu_evidence_never_verifies_under_nvidias_roots(sim_gpu: SimGpu) -> None:
    nonce = os.urandom(32)
    verdict = verify_gpu(sim_gpu.report(nonce), sim_gpu.cert_chain_pem(), nonce, rims=list(sim_gpu.rims()))
    assert verdict.failed is not None and verdict.failed.name == f"{P}-cert-chain"


def test_a_sim_report_for_another_nonce_is_refused(sim_gpu: SimGpu) -> None:
    verdict = verify_gpu(sim_gpu.report(bytes(32)), sim_gpu.cert_chain_pem(), os.urandom(32),
                         rims=list(sim_gpu.rims()), device_root=sim_gpu.pki.device_root,
                         rim_root=sim_gpu.pki.rim_root)
    assert verdict.failed is not None and verdict.failed.name == f"{P}-nonce-match"


def test_a_sim_gpu_whose_measurement_drifted_from_its_rims_fails_measres_naming_the_index() -> None:
    gpu = SimGpu.generate(seed=b"drift")
    rims = list(gpu.rims())
    gpu.measurements[20] = bytes(48)  # the firmware changed after the RIMs were signed
    nonce = os.urandom(32)
    verdict = verify_gpu(gpu.report(nonce), gpu.cert_chain_pem(), nonce, rims=rims,
                         device_root=gpu.pki.device_root, rim_root=gpu.pki.rim_root)
    assert verdict.failed is not None and verdict.failed.name == "measres" and "[20]" in verdict.failed.detail


def test_the_cli_pins_the_sim_roots_from_the_policy_file(tmp_path: Path, sim_gpu: SimGpu) -> None:
    from gputravel.console.cli.main import app

    nonce = os.urandom(32)
    (tmp_path / "report.bin").write_bytes(sim_gpu.report(nonce))
    (tmp_path / "chain.pem").write_bytes(sim_gpu.cert_chain_pem())
    driver, vbios = sim_gpu.rims()
    (tmp_path / "driver.swidtag").write_bytes(driver)
    (tmp_path / "vbios.swidtag").write_bytes(vbios)
    (tmp_path / "sim-device-root.crt").write_bytes(sim_gpu.pki.device_root.public_bytes(Encoding.PEM))
    (tmp_path / "sim-rim-root.crt").write_bytes(sim_gpu.pki.rim_root.public_bytes(Encoding.PEM))
    policy = tmp_path / "sim.toml"
    policy.write_text('[nvidia-gpu]\ndevice_root = "sim-device-root.crt"\nrim_root = "sim-rim-root.crt"\n')
    assert load_evidence_policy(policy).gpu.device_root == (tmp_path / "sim-device-root.crt").resolve()
    args = ["attest", "--evidence", str(tmp_path / "report.bin"), "--cert-chain", str(tmp_path / "chain.pem"),
            "--nonce", nonce.hex(), "--rim", str(tmp_path / "driver.swidtag"), "--rim",
            str(tmp_path / "vbios.swidtag"), "--json"]
    out = CliRunner().invoke(app, [*args, "--policy", str(policy)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["claims"]["measres"] == "success"
    refused = CliRunner().invoke(app, args)  # the shipped policy pins NVIDIA's roots
    assert refused.exit_code == 3 and f"{P}-cert-chain" in refused.stderr


def test_a_policy_root_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    from gputravel.core.evidence.policy import PolicyError

    policy = tmp_path / "p.toml"
    policy.write_text('[nvidia-gpu]\ndevice_root = "missing.crt"\n')
    with pytest.raises(PolicyError, match="missing.crt"):
        load_evidence_policy(policy)
    assert GpuPolicy().device_root is None  # default: NVIDIA's, shipped


# --- SIM TDX ----------------------------------------------------------------------------------------------------
NOW = 1_800_000_000
ISSUED = dt.datetime.fromtimestamp(NOW - 3600, dt.UTC)


@pytest.fixture(scope="module")
def sim_tdx() -> SimTdx:
    return SimTdx.generate()


def test_sim_tdx_quote_verifies_with_the_sim_root_and_binds_the_report_data(sim_tdx: SimTdx) -> None:
    report_data = os.urandom(64)
    verdict = verify_tdx_quote(sim_tdx.quote(report_data), sim_tdx.collateral(issued=ISSUED), now=NOW,
                               root_ca_der=sim_tdx.pki.root_der)
    assert verdict.ok, verdict.reason
    assert verdict.tcb_status == "UpToDate"
    assert verdict.report_data == report_data.hex()
    assert verdict.mr_td == sim_tdx.mr_td.hex()


def test_sim_tdx_quote_never_verifies_under_intels_root(sim_tdx: SimTdx) -> None:
    verdict = verify_tdx_quote(sim_tdx.quote(bytes(64)), sim_tdx.collateral(issued=ISSUED), now=NOW)
    assert not verdict.ok and verdict.failed == "quote-verified"


def test_a_changed_report_data_byte_of_a_sim_quote_is_refused(sim_tdx: SimTdx) -> None:
    quote = bytearray(sim_tdx.quote(bytes(64)))
    quote[48 + 520] ^= 0x01
    verdict = verify_tdx_quote(bytes(quote), sim_tdx.collateral(issued=ISSUED), now=NOW,
                               root_ca_der=sim_tdx.pki.root_der)
    assert not verdict.ok and verdict.failed == "quote-verified"


def test_expired_sim_collateral_is_refused(sim_tdx: SimTdx) -> None:
    verdict = verify_tdx_quote(sim_tdx.quote(bytes(64)), sim_tdx.collateral(issued=ISSUED, valid_days=1),
                               now=NOW + 2 * 86400, root_ca_der=sim_tdx.pki.root_der)
    assert not verdict.ok and verdict.failed == "quote-verified" and "expired" in verdict.reason.lower()


def test_a_signed_debug_td_quote_is_refused_naming_td_not_debug(sim_tdx: SimTdx) -> None:
    quote = sim_tdx.quote(bytes(64), debug=True)
    verdict = verify_tdx_quote(quote, sim_tdx.collateral(issued=ISSUED), now=NOW, root_ca_der=sim_tdx.pki.root_der)
    assert not verdict.ok and verdict.failed == "td-not-debug"
    assert "ebug" in verdict.reason


def test_an_mr_td_off_the_allow_list_is_refused(sim_tdx: SimTdx) -> None:
    quote = sim_tdx.quote(bytes(64), mr_td=bytes(48))
    policy = TdxPolicy(mr_td=(sim_tdx.mr_td.hex(),))
    verdict = verify_tdx_quote(quote, sim_tdx.collateral(issued=ISSUED), now=NOW, root_ca_der=sim_tdx.pki.root_der,
                               policy=policy)
    assert verdict.checks["quote-verified"] is True and verdict.failed == "mr-td"


def test_the_cli_pins_the_sim_tdx_root_from_the_policy_file(tmp_path: Path, sim_tdx: SimTdx) -> None:
    from gputravel.console.cli.main import app

    (tmp_path / "quote.bin").write_bytes(sim_tdx.quote(bytes(64)))
    (tmp_path / "collateral.json").write_text(sim_tdx.collateral(issued=ISSUED))
    (tmp_path / "sim-sgx-root.crt").write_bytes(sim_tdx.pki.root.public_bytes(Encoding.PEM))
    (tmp_path / "sim.toml").write_text('[intel-tdx]\nroot_ca = "sim-sgx-root.crt"\n')
    args = ["attest", "--tdx-quote", str(tmp_path / "quote.bin"), "--collateral", str(tmp_path / "collateral.json"),
            "--at", str(NOW), "--json"]
    out = CliRunner().invoke(app, [*args, "--policy", str(tmp_path / "sim.toml")])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["tcb_status"] == "UpToDate"
    assert CliRunner().invoke(app, args).exit_code == 3  # the shipped policy pins Intel's root


def test_bench_evidence_checks_every_sim_format_and_reports_json() -> None:
    from gputravel.console.cli.main import app

    out = CliRunner().invoke(app, ["bench", "evidence", "--rounds", "2", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["sim"] is True
    assert set(doc["timings"]) == {"gpu_report_per_visit", "gpu_report_and_chain", "gpu_with_rims",
                                   "tdx_quote_and_collateral", "snp_report_real_milan", "snp_report_sim",
                                   "azure_hcl_and_quote_sim"}
    assert doc["per_visit_ms"] > 0
    assert doc["snp"]["notes"] == []  # the real Milan sample is found in a checkout
    mem = doc["memory"]
    assert 0 < mem["decode_at_cap_peak_bytes"] <= min(mem["target_ratio"] * mem["cap_bytes"], mem["target_max_bytes"])


def test_a_chain_through_a_certificate_that_is_not_a_ca_is_refused() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    from gputravel.core.evidence.nvidia_spdm import check_chain
    from gputravel.core.evidence.sim_gpu import _cert

    root_key, mid_key, leaf_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(3))
    root = _cert("SIM root", root_key, "SIM root", root_key, ca=True)
    mid = _cert("SIM end entity", mid_key, "SIM root", root_key, ca=False)  # may not issue certificates
    leaf = _cert("SIM leaf", leaf_key, "SIM end entity", mid_key, ca=False)
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    why = check_chain([leaf, mid, root], root, at=now, length=None)
    assert why is not None and "not a CA" in why
    assert check_chain([mid, root], root, at=now, length=None) is None


def test_attest_sim_formats_keeps_its_sim_identities_and_verifies_both_formats(tmp_path: Path) -> None:
    from gputravel.console.cli.main import app

    state = tmp_path / "state"
    first = CliRunner().invoke(app, ["attest", "--sim-formats", "--state-dir", str(state), "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["ok"] is True and doc["platform"]["label"] == "SIM"
    assert doc["nvidia-gpu"]["claims"]["measres"] == "success" and doc["intel-tdx"]["tcb_status"] == "UpToDate"
    folder = state / "vendor-formats"
    root = (folder / "gpu-root.crt").read_bytes()
    assert (folder / "gpu-leaf.key").stat().st_mode & 0o077 == 0  # private keys: owner only
    second = CliRunner().invoke(app, ["attest", "--sim-formats", "--state-dir", str(state), "--out",
                                      str(tmp_path / "out"), "--json"])
    assert second.exit_code == 0 and (folder / "gpu-root.crt").read_bytes() == root  # the same SIM identity
    out = tmp_path / "out"
    args = ["attest", "--evidence", str(out / "gpu-report.bin"), "--cert-chain", str(out / "gpu-chain.pem"),
            "--nonce", (out / "nonce.txt").read_text().strip(), "--rim", str(out / "driver-rim.swidtag"),
            "--rim", str(out / "vbios-rim.swidtag")]
    assert CliRunner().invoke(app, [*args, "--policy", str(folder / "sim-evidence.toml")]).exit_code == 0
    assert CliRunner().invoke(app, args).exit_code == 3  # NVIDIA's roots refuse SIM evidence


def test_a_broken_sim_identity_folder_is_made_anew(tmp_path: Path) -> None:
    from gputravel.core.evidence.sim_store import load_or_create

    gpu, _, _ = load_or_create(tmp_path)
    (tmp_path / "vendor-formats" / "gpu-leaf.key").write_text("not a key")
    again, _, policy = load_or_create(tmp_path)
    assert again.pki.device_root != gpu.pki.device_root
    nonce = os.urandom(32)
    verdict = verify_gpu(again.report(nonce), again.cert_chain_pem(), nonce, rims=list(again.rims()),
                         policy=load_evidence_policy(policy).gpu)
    assert verdict.ok, verdict.failed
