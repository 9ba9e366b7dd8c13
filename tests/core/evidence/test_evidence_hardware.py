"""The real-hardware path, driven by recorded data (no CC-mode H100 and no TDX guest here): NVIDIA's sample report
and chain inside NVML's own ctypes structures, dcap-qvl's real quote in a configfs-tsm-shaped folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from evidence_samples import (  # noqa: F401 (the *_fixture names are pytest fixtures)
    SAMPLE_NONCE,
    NvidiaSample,
    RecordedNvml,
    nv_wheel_fixture,
    sample_fixture,
)
from helpers import DATA_DIR

from gputravel.core.attestation.hardware_evidence import (
    gpu_evidence_from_nvml,
    nvml_cc_mode,
    read_tsm_report,
    tdx_quote_from_configfs,
)
from gputravel.core.errors import AttestationError
from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.policy import GpuPolicy
from gputravel.core.evidence.tdx import verify_tdx_quote

TDX = DATA_DIR / "intel-tdx"


def test_recorded_nvml_answer_verifies_under_its_nonce(sample: NvidiaSample) -> None:
    evidence = gpu_evidence_from_nvml(RecordedNvml(sample), 0, SAMPLE_NONCE)
    verdict = verify_gpu(evidence.report, evidence.cert_chain, evidence.nonce, policy=GpuPolicy(require_rims=False))
    assert verdict.ok, verdict.failed


@pytest.mark.parametrize(("driver", "vbios", "claim"), [
    ("550.90.08", "96.00.9F.00.01", "driver-version-match"),
    ("550.90.07", "96.00.9F.00.02", "vbios-version-match"),
])
def test_a_report_whose_versions_differ_from_nvmls_is_refused(sample: NvidiaSample, driver: str, vbios: str,
                                                              claim: str) -> None:
    evidence = gpu_evidence_from_nvml(RecordedNvml(sample), 0, SAMPLE_NONCE)
    assert (evidence.driver_version, evidence.vbios_version) == ("550.90.07", "96.00.9F.00.01")
    with pytest.raises(AttestationError, match=f"x-nvidia-gpu-attestation-report-{claim}"):
        gpu_evidence_from_nvml(RecordedNvml(sample, driver=driver, vbios=vbios), 0, SAMPLE_NONCE)


def test_a_replayed_answer_to_a_fresh_nonce_fails_nonce_match(sample: NvidiaSample) -> None:
    fresh = bytes(range(32))
    evidence = gpu_evidence_from_nvml(RecordedNvml(sample), 0, fresh)
    verdict = verify_gpu(evidence.report, evidence.cert_chain, fresh, policy=GpuPolicy(require_rims=False))
    assert verdict.failed is not None and verdict.failed.name == "x-nvidia-gpu-attestation-report-nonce-match"


@pytest.mark.parametrize(("cc", "devtools", "mode"), [(0, 0, "off"), (1, 1, "devtools")])
def test_no_evidence_is_taken_outside_cc_mode_on(sample: NvidiaSample, cc: int, devtools: int, mode: str) -> None:
    nvml = RecordedNvml(sample, cc=cc, devtools=devtools)
    assert nvml_cc_mode(nvml) == mode
    with pytest.raises(AttestationError, match=mode):
        gpu_evidence_from_nvml(nvml, 0, SAMPLE_NONCE)


def _tsm_entry(tmp_path: Path, provider: str = "tdx_guest") -> tuple[Path, bytes]:
    quote = (TDX / "tdx_quote").read_bytes()
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "provider").write_text(provider + "\n")
    (entry / "outblob").write_bytes(quote)
    report_data = bytes.fromhex(verify_tdx_quote(quote, (TDX / "tdx_quote_collateral.json").read_bytes(),
                                                 now=1750331763).report_data)
    return entry, report_data


def test_a_recorded_tsm_report_yields_the_quote_binding_the_written_report_data(tmp_path: Path) -> None:
    entry, report_data = _tsm_entry(tmp_path)
    assert read_tsm_report(entry, report_data) == (TDX / "tdx_quote").read_bytes()


def test_a_tsm_quote_binding_other_report_data_is_refused(tmp_path: Path) -> None:
    entry, report_data = _tsm_entry(tmp_path)
    with pytest.raises(AttestationError, match="other report data"):
        read_tsm_report(entry, bytes(64))


def test_a_non_tdx_tsm_provider_is_refused(tmp_path: Path) -> None:
    entry, report_data = _tsm_entry(tmp_path, provider="sev_guest")
    with pytest.raises(AttestationError, match="not a TDX guest"):
        read_tsm_report(entry, report_data)


def test_outside_a_tdx_guest_configfs_tsm_is_missing_and_says_so(tmp_path: Path) -> None:
    with pytest.raises(AttestationError, match="configfs-tsm"):
        tdx_quote_from_configfs(bytes(64), root=tmp_path / "no-such-configfs")


def test_the_device_answers_holders_with_the_drivers_evidence_where_cc_mode_is_on(sample: NvidiaSample) -> None:
    """The device's ``gpu_evidence`` operation on a CC-mode GPU: the driver's report and chain (NVIDIA's recorded
    sample in NVML's structures), not the SIM GPU's; it verifies against NVIDIA's root; no tampering there."""
    from gputravel.core.device.spdm import SpdmResponder
    from gputravel.core.errors import DeviceError

    responder = SpdmResponder(nvml=RecordedNvml(sample))
    answer = responder.answer(nonce=SAMPLE_NONCE.hex(), chain=True)
    assert answer["sim"] is False
    verdict = verify_gpu(bytes.fromhex(answer["report"]), answer["chain"].encode(), SAMPLE_NONCE,
                         policy=GpuPolicy(require_rims=False))
    assert verdict.ok, verdict.failed
    with pytest.raises(DeviceError, match="SIM GPU only"):
        responder.answer(nonce=SAMPLE_NONCE.hex(), tamper="measurement")


def test_outside_cc_mode_the_device_answers_with_the_sim_gpu(sample: NvidiaSample) -> None:
    from gputravel.core.device.spdm import SpdmResponder

    responder = SpdmResponder(nvml=False)  # what detection leaves where NVML says CC mode is not on
    assert responder.hardware() is None
    assert responder.answer(nonce=SAMPLE_NONCE.hex())["sim"] is True
