"""SIM evidence in the vendors' formats: one verifier for real and SIM evidence, only the pinned roots differ."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from typer.testing import CliRunner

from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.policy import GpuPolicy, load_evidence_policy
from gputravel.core.evidence.sim_gpu import SimGpu

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
    assert verdict.failed is not None and verdict.failed.name == f"{P}-cert-chain-validated"


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
    from gputravel.console.cli import app

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
    assert refused.exit_code == 3 and f"{P}-cert-chain-validated" in refused.stderr


def test_a_policy_root_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    from gputravel.core.evidence.policy import PolicyError

    policy = tmp_path / "p.toml"
    policy.write_text('[nvidia-gpu]\ndevice_root = "missing.crt"\n')
    with pytest.raises(PolicyError, match="missing.crt"):
        load_evidence_policy(policy)
    assert GpuPolicy().device_root is None  # default: NVIDIA's, shipped
