"""SEV-SNP evidence from real hardware (issue 31 item 2): a guest's report through configfs-tsm or /dev/sev-guest,
and an Azure CVM's HCL report and TPM2 quote through its vTPM.

None of this runs on this project's machines (no SNP guest, no Azure CVM); the tests drive the same code with
recorded data: virtee's real Milan report (and its VCEK in a GHCB certificate table) in a configfs-shaped folder
and behind a recorded ``/dev/sev-guest`` ioctl, Azure's real HCL report and quote inside TPM2 responses.

* configfs-tsm (Linux >= 6.7): ``mkdir /sys/kernel/config/tsm/report/<name>``, write 64 bytes to ``inblob``, read
  the report from ``outblob`` (and, where the host supplies them, the certificates from ``auxblob``: a GHCB
  certificate table, GUID -> VCEK/ASK/ARK). ``provider`` must be ``sev_guest``, ``generation`` advance by one.
* ``/dev/sev-guest``: ioctl ``SNP_GET_REPORT`` (``_IOWR('S', 0x0, struct snp_guest_request_ioctl)``) with
  ``struct snp_report_req`` (report data, VMPL) and a 4000-byte response (``SNP_REPORT_RSP``: status, size, the
  report).
* Azure: TPM2_NV_Read of index 0x01400001 (the HCL report, owner authorisation, empty password) and TPM2_Quote by
  the attestation key at persistent handle 0x81000003 over the verifier's nonce, SHA-256 PCRs 0-23, through
  ``/dev/tpmrm0``; the answer is serialised as ``core.evidence.azure_snp`` reads it.
"""

from __future__ import annotations

import ctypes
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.attestation.hardware_evidence import configfs_tsm_report
from gputravel.core.errors import AttestationError

__all__ = ["AZURE_AK_HANDLE", "HCL_NV_INDEX", "SNP_GET_REPORT", "SnpGuestRequest", "SnpReportReq", "TpmTransport",
           "azure_evidence_from_vtpm", "parse_cert_table", "read_snp_tsm_report", "snp_report_from_configfs", "snp_report_from_sev_guest"]

REPORT_DATA_LEN = 64
SNP_REPORT_LEN = 1184
TSM_REPORT_ROOT = Path("/sys/kernel/config/tsm/report")
# GHCB spec, the extended guest request's certificate table: GUIDs of AMD's certificates
CERT_GUIDS = {"63da758d-e664-4564-adc5-f4b93be8accd": "vcek", "a8074bc2-a25a-483e-aae6-39c045a0b8a1": "vlek",
              "4ab7b379-bbac-4fe4-a02f-05aef327c782": "ask", "c0b406a4-a803-4952-9743-3fb6014cd0ae": "ark"}
SNP_GET_REPORT = (3 << 30) | (32 << 16) | (ord("S") << 8) | 0x0  # _IOWR('S', 0x0, 32-byte request)
SNP_MSG_VERSION = 1
RESP_LEN = 4000
HCL_NV_INDEX = 0x01400001
AZURE_AK_HANDLE = 0x81000003


def parse_cert_table(table: bytes) -> dict[str, bytes]:
    """``{"vcek": DER, "ask": DER, ...}`` from a GHCB certificate table (entries of GUID, offset, length; an
    all-zero entry ends it); unknown GUIDs are skipped.

    Raises:
        AttestationError: an entry points outside the table.
    """
    certs: dict[str, bytes] = {}
    for pos in range(0, len(table) - 23, 24):
        guid, offset, length = table[pos:pos + 16], *struct.unpack_from("<II", table, pos + 16)
        if not any(table[pos:pos + 24]):
            break
        if offset + length > len(table):
            raise AttestationError(f"the certificate table's entry at {pos} points past its end")
        name = CERT_GUIDS.get(str(uuid.UUID(bytes_le=bytes(guid))))
        if name is not None:
            certs[name] = table[offset:offset + length]
    return certs


def _check_report(report: bytes, report_data: bytes, where: str) -> bytes:
    if len(report) != SNP_REPORT_LEN:
        raise AttestationError(f"{where}: {len(report)} bytes, not an SEV-SNP report ({SNP_REPORT_LEN})")
    if report[0x50:0x90] != report_data:
        raise AttestationError(f"{where}: the report binds other report data than was asked for")
    return report


def read_snp_tsm_report(entry: Path, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
    """The report of a configfs-tsm entry whose ``inblob`` was written with ``report_data``, and the certificates
    of its ``auxblob`` (empty when the host supplies none: fetch the VCEK from AMD's KDS then).

    Raises:
        AttestationError: not an SEV-SNP provider, no report, or the report binds other report data.
    """
    try:
        provider = (entry / "provider").read_text().strip()
        report = (entry / "outblob").read_bytes()
        aux = (entry / "auxblob").read_bytes() if (entry / "auxblob").is_file() else b""
    except OSError as exc:
        raise AttestationError(f"{entry}: cannot read the TSM report ({exc.strerror})") from exc
    if provider != "sev_guest":
        raise AttestationError(f"{entry}: the TSM provider is {provider!r}, not an SEV-SNP guest (sev_guest)")
    return _check_report(report, report_data, str(entry)), parse_cert_table(aux) if aux else {}


def snp_report_from_configfs(report_data: bytes, *, root: Path = TSM_REPORT_ROOT) -> tuple[bytes, dict[str, bytes]]:
    """A fresh SNP report binding ``report_data`` (64 bytes), and the host's certificates, from inside a guest.

    Raises:
        AttestationError: no configfs-tsm, a race (``generation``), or a bad report.
    """
    if len(report_data) != REPORT_DATA_LEN:
        raise AttestationError(f"SNP report data must be {REPORT_DATA_LEN} bytes, not {len(report_data)}")
    return configfs_tsm_report(root, report_data, read_snp_tsm_report, guest="an SEV-SNP guest")


class SnpReportReq(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint8 * 64), ("vmpl", ctypes.c_uint32), ("rsvd", ctypes.c_uint8 * 28)]


class SnpGuestRequest(ctypes.Structure):
    _fields_ = [("msg_version", ctypes.c_uint8), ("req_data", ctypes.c_uint64), ("resp_data", ctypes.c_uint64),
                ("exitinfo2", ctypes.c_uint64)]


IoctlFn = Callable[[int, int, Any], Any]


def _ioctl(fd: int, request: int, arg: Any) -> Any:
    import fcntl

    return fcntl.ioctl(fd, request, arg)


def snp_report_from_sev_guest(report_data: bytes, *, vmpl: int = 0, device: str = "/dev/sev-guest",
                              ioctl: IoctlFn = _ioctl) -> bytes:
    """A fresh SNP report through the sev-guest driver's ``SNP_GET_REPORT`` ioctl (older kernels, no configfs-tsm).

    Raises:
        AttestationError: no device, a firmware or VMM error, or a report that binds other report data.
    """
    if len(report_data) != REPORT_DATA_LEN:
        raise AttestationError(f"SNP report data must be {REPORT_DATA_LEN} bytes, not {len(report_data)}")
    req = SnpReportReq(vmpl=vmpl)
    ctypes.memmove(req.user_data, report_data, REPORT_DATA_LEN)
    resp = (ctypes.c_uint8 * RESP_LEN)()
    guest = SnpGuestRequest(msg_version=SNP_MSG_VERSION, req_data=ctypes.addressof(req),
                          resp_data=ctypes.addressof(resp))
    try:
        fd = os.open(device, os.O_RDWR)
    except OSError as exc:
        raise AttestationError(f"{device}: no SEV-SNP guest device ({exc.strerror})") from exc
    try:
        ioctl(fd, SNP_GET_REPORT, guest)
    except OSError as exc:
        raise AttestationError(f"{device}: SNP_GET_REPORT failed ({exc.strerror}; firmware error "
                               f"{guest.exitinfo2 & 0xFFFFFFFF:#x}, VMM error {guest.exitinfo2 >> 32:#x})") from exc
    finally:
        os.close(fd)
    raw = bytes(resp)
    status, size = struct.unpack_from("<II", raw, 0)
    if status != 0 or size != SNP_REPORT_LEN:
        raise AttestationError(f"{device}: the firmware answered status {status:#x}, a report of {size} bytes")
    return _check_report(raw[32:32 + size], report_data, device)


# --- Azure: the vTPM ----------------------------------------------------------------------------------------
TPM_ST_NO_SESSIONS, TPM_ST_SESSIONS = 0x8001, 0x8002
TPM_CC_NV_READ, TPM_CC_NV_READ_PUBLIC, TPM_CC_QUOTE = 0x0000014E, 0x00000169, 0x00000158
TPM_RH_OWNER, TPM_RS_PW = 0x40000001, 0x40000009
TPM_ALG_RSASSA, TPM_ALG_SHA256, TPM_ALG_NULL = 0x0014, 0x000B, 0x0010
NV_CHUNK = 1024


class TpmTransport:
    """Commands to a TPM as bytes in, bytes out (``/dev/tpmrm0``; a test gives recorded answers instead)."""

    def __init__(self, path: str = "/dev/tpmrm0") -> None:
        self.path = path

    def transmit(self, command: bytes) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise AttestationError(f"{self.path}: no TPM here ({exc.strerror}); is this an Azure CVM?") from exc
        try:
            os.write(fd, command)
            return os.read(fd, 8192)
        finally:
            os.close(fd)


def _command(tag: int, code: int, body: bytes) -> bytes:
    return struct.pack(">HII", tag, 10 + len(body), code) + body


_PW_SESSION = struct.pack(">I", 9) + struct.pack(">IHBH", TPM_RS_PW, 0, 0x01, 0)  # empty password, continueSession


def _answer(raw: bytes, what: str) -> bytes:
    if len(raw) < 10:
        raise AttestationError(f"TPM: a {what} answer of {len(raw)} bytes")
    _tag, size, rc = struct.unpack_from(">HII", raw, 0)
    if rc != 0 or size != len(raw):
        raise AttestationError(f"TPM: {what} failed (response code {rc:#x})")
    return raw[10:]


@dataclass(frozen=True, slots=True)
class AzureVtpmEvidence:
    hcl_report: bytes
    quote: bytes  # azure-cvm-tooling's serialised form (core.evidence.azure_snp.parse_tpm_quote)


def _nv_size(tpm: TpmTransport) -> int:
    body = _answer(tpm.transmit(_command(TPM_ST_NO_SESSIONS, TPM_CC_NV_READ_PUBLIC,
                                         struct.pack(">I", HCL_NV_INDEX))), "NV_ReadPublic")
    # TPM2B_NV_PUBLIC: size, nvIndex(4) nameAlg(2) attributes(4) authPolicy(TPM2B) dataSize(2)
    (pol_len,) = struct.unpack_from(">H", body, 2 + 10)
    (data_size,) = struct.unpack_from(">H", body, 2 + 12 + pol_len)
    return int(data_size)


def azure_evidence_from_vtpm(nonce: bytes, *, tpm: TpmTransport | None = None) -> AzureVtpmEvidence:
    """The HCL report (NV index 0x01400001) and a quote by the AK over ``nonce`` (at most 64 bytes).

    Raises:
        AttestationError: no TPM, a TPM error, or an answer of the wrong shape.
    """
    if not 0 < len(nonce) <= 64:
        raise AttestationError(f"the quote's nonce must be 1 to 64 bytes, not {len(nonce)}")
    tpm = tpm or TpmTransport()
    size, report = _nv_size(tpm), b""
    while len(report) < size:
        n = min(NV_CHUNK, size - len(report))
        body = struct.pack(">II", TPM_RH_OWNER, HCL_NV_INDEX) + _PW_SESSION + struct.pack(">HH", n, len(report))
        out = _answer(tpm.transmit(_command(TPM_ST_SESSIONS, TPM_CC_NV_READ, body)), "NV_Read")
        (chunk_len,) = struct.unpack_from(">H", out, 4)  # after the parameter size
        report += out[6:6 + chunk_len]
        if chunk_len == 0:
            raise AttestationError("TPM: NV_Read returned no bytes")
    selection = struct.pack(">IHB", 1, TPM_ALG_SHA256, 3) + b"\xff\xff\xff"
    body = (struct.pack(">I", AZURE_AK_HANDLE) + _PW_SESSION + struct.pack(">H", len(nonce)) + nonce
            + struct.pack(">HH", TPM_ALG_RSASSA, TPM_ALG_SHA256) + selection)
    out = _answer(tpm.transmit(_command(TPM_ST_SESSIONS, TPM_CC_QUOTE, body)), "Quote")
    (attest_len,) = struct.unpack_from(">H", out, 4)
    attest = out[6:6 + attest_len]
    pos = 6 + attest_len
    sig_alg, _hash, sig_len = struct.unpack_from(">HHH", out, pos)
    if sig_alg != TPM_ALG_RSASSA:
        raise AttestationError(f"TPM: the quote is signed with algorithm {sig_alg:#x}, not RSASSA")
    signature = out[pos + 6:pos + 6 + sig_len]
    serial = (struct.pack("<Q", len(signature)) + signature + struct.pack("<Q", len(attest)) + attest
              + struct.pack("<Q", 0))  # the PCR values are not read here: the digest in the quote stands for them
    return AzureVtpmEvidence(hcl_report=report, quote=serial)
