"""Evidence from real hardware: an H100's SPDM report and certificates through NVML, a TD's quote through the
kernel's configfs-tsm report interface.

Neither runs on a machine without a CC-mode GPU or outside a TDX guest. The tests drive the same code with
recorded data (NVIDIA's sample report and chain in NVML's own ctypes structures, dcap-qvl's real quote in a
configfs-shaped folder); docs/attestation.md says how to run it for real.

* GPU: ``nvmlSystemGetConfComputeState()`` must say CC on (``ccFeature`` enabled) and devtools off; then
  ``nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)`` returns the GET_MEASUREMENTS request + response
  under the verifier's 32-byte nonce and ``nvmlDeviceGetConfComputeGpuCertificate(handle)`` the PEM chain
  (``attestationCertChain``, leaf first, the Device Identity CA last). The report's driver and VBIOS versions
  must be NVML's (``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetVbiosVersion``), as NVIDIA's verifier checks.
* TDX: ``mkdir /sys/kernel/config/tsm/report/<name>``, write 64 bytes of report data to ``inblob``, read the quote
  from ``outblob``; ``provider`` must be ``tdx_guest`` and ``generation`` unchanged between write and read (else
  another writer raced us). The quote's own report_data must be what was written.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gputravel.core.errors import AttestationError

__all__ = ["GpuEvidence", "TSM_REPORT_ROOT", "gpu_evidence_from_nvml", "nvml_cc_mode", "read_tsm_report",
           "tdx_quote_from_configfs"]

NONCE_LEN = 32
REPORT_DATA_LEN = 64
TSM_REPORT_ROOT = Path("/sys/kernel/config/tsm/report")
NVML_CC_FEATURE_ENABLED = 1
NVML_CC_DEVTOOLS_OFF = 0


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """What ``gputravel attest --evidence FILE --cert-chain FILE`` reads, straight from the driver."""

    report: bytes
    cert_chain: bytes
    nonce: bytes
    driver_version: str = ""  # what NVML says (nvmlSystemGetDriverVersion), equal to the report's
    vbios_version: str = ""  # what NVML says (nvmlDeviceGetVbiosVersion), equal to the report's


def nvml_cc_mode(nvml: Any) -> str:
    """``on``, ``devtools`` or ``off`` as the driver reports the system's confidential-computing state."""
    state = nvml.nvmlSystemGetConfComputeState()
    if int(state.ccFeature) != NVML_CC_FEATURE_ENABLED:
        return "off"
    return "on" if int(state.devToolsMode) == NVML_CC_DEVTOOLS_OFF else "devtools"


def gpu_evidence_from_nvml(nvml: Any, index: int, nonce: bytes) -> GpuEvidence:
    """The GPU's SPDM report under ``nonce`` and its certificate chain, from an initialised ``pynvml``.

    Raises:
        AttestationError: CC mode is not on, the nonce is not 32 bytes, or the driver returns no report/chain.
    """
    if len(nonce) != NONCE_LEN:
        raise AttestationError(f"the GPU attestation nonce must be {NONCE_LEN} bytes, not {len(nonce)}")
    mode = nvml_cc_mode(nvml)
    if mode != "on":
        raise AttestationError(f"the GPU's confidential-computing mode is {mode!r}: no attestation report is "
                               "trustworthy outside CC mode 'on'")
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    rep = nvml.nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)
    size = int(rep.attestationReportSize)
    if size <= 0 or size > len(rep.attestationReport):
        raise AttestationError(f"the driver returned an attestation report of {size} bytes")
    report = bytes(rep.attestationReport[:size])
    cert = nvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
    csize = int(cert.attestationCertChainSize)
    if csize <= 0 or csize > len(cert.attestationCertChain):
        raise AttestationError(f"the driver returned an attestation certificate chain of {csize} bytes")
    driver, vbios = _versions_match_nvml(nvml, handle, report)
    return GpuEvidence(report=report, cert_chain=bytes(cert.attestationCertChain[:csize]), nonce=nonce,
                       driver_version=driver, vbios_version=vbios)


def _text(value: Any) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def _versions_match_nvml(nvml: Any, handle: Any, report: bytes) -> tuple[str, str]:
    """NVML's driver and VBIOS versions, after checking the report says the same (as NVIDIA's verifier does:
    a report from another driver or firmware than the one loaded is refused).

    Raises:
        AttestationError: the report does not parse, or a version differs (the claim is named).
    """
    from gputravel.core.evidence.nvidia_spdm import EvidenceFormatError, parse_report

    try:
        parsed = parse_report(report)
    except EvidenceFormatError as exc:
        raise AttestationError(f"x-nvidia-gpu-attestation-report-parsed: {exc}") from exc
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    vbios = _text(nvml.nvmlDeviceGetVbiosVersion(handle))
    if parsed.driver_version != driver:
        raise AttestationError(f"x-nvidia-gpu-attestation-report-driver-version-match: the report says driver "
                               f"{parsed.driver_version!r}, NVML {driver!r}")
    if parsed.vbios_version.lower() != vbios.lower():
        raise AttestationError(f"x-nvidia-gpu-attestation-report-vbios-version-match: the report says VBIOS "
                               f"{parsed.vbios_version.upper()!r}, NVML {vbios!r}")
    return driver, vbios


def read_tsm_report(entry: Path, report_data: bytes) -> bytes:
    """The quote of a configfs-tsm report entry whose ``inblob`` was written with ``report_data``.

    Raises:
        AttestationError: not a TDX provider, no quote, or the quote binds other report data.
    """
    import dcap_qvl

    try:
        provider = (entry / "provider").read_text().strip()
        quote = (entry / "outblob").read_bytes()
    except OSError as exc:
        raise AttestationError(f"{entry}: cannot read the TSM report ({exc.strerror})") from exc
    if provider != "tdx_guest":
        raise AttestationError(f"{entry}: the TSM provider is {provider!r}, not a TDX guest")
    try:
        parsed = dcap_qvl.parse_quote(quote)
        bound = bytes(parsed.report.report_data)
    except (ValueError, TypeError, AttributeError) as exc:
        raise AttestationError(f"{entry}: outblob is not a TDX quote ({exc})") from exc
    if bound != report_data:
        raise AttestationError(f"{entry}: the quote binds other report data than was written")
    return quote


_Report = TypeVar("_Report")


def configfs_tsm_report(root: Path, report_data: bytes, read: Callable[[Path, bytes], _Report], *,
                        guest: str) -> _Report:
    """One configfs-tsm report (TDX quote or SNP report, ``read`` takes it out of the entry): make an entry under
    ``root``, write ``report_data`` to its ``inblob``, read, check that no other writer raced us (``generation``
    went up by exactly one), remove the entry. ``guest`` names the guest the interface belongs to, for the error.

    Raises:
        AttestationError: no configfs-tsm interface, a race, or the report failed.
    """
    entry = root / f"gputravel-{uuid.uuid4().hex}"
    try:
        os.mkdir(entry)
    except OSError as exc:
        raise AttestationError(f"{root}: no configfs-tsm report interface here ({exc.strerror}); "
                               f"is this {guest} with configfs mounted?") from exc
    try:
        before = (entry / "generation").read_text().strip()
        (entry / "inblob").write_bytes(report_data)
        out = read(entry, report_data)
        after = (entry / "generation").read_text().strip()
        if after != str(int(before) + 1):
            raise AttestationError(f"{entry}: generation went {before} -> {after}; another writer raced us")
        return out
    except OSError as exc:
        raise AttestationError(f"{entry}: the TSM report failed ({exc.strerror})") from exc
    finally:
        try:
            os.rmdir(entry)
        except OSError:
            pass


def tdx_quote_from_configfs(report_data: bytes, *, root: Path = TSM_REPORT_ROOT) -> bytes:
    """A fresh TDX quote binding ``report_data`` (64 bytes), from inside a TDX guest.

    Raises:
        AttestationError: no configfs-tsm (not a TDX guest, or configfs not mounted), a race, or a bad quote.
    """
    if len(report_data) != REPORT_DATA_LEN:
        raise AttestationError(f"TDX report data must be {REPORT_DATA_LEN} bytes, not {len(report_data)}")
    return configfs_tsm_report(root, report_data, read_tsm_report, guest="a TDX guest")
