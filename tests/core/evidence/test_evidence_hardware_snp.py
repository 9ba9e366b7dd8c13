"""The SEV-SNP hardware paths on recorded data (no SNP guest, no Azure CVM here): virtee's real Milan report and
VCEK in a configfs-tsm-shaped folder and behind a recorded ``/dev/sev-guest`` ioctl (RecordedSevGuest), and
azure-cvm-tooling's real HCL report and quote inside TPM2 responses (RecordedVtpm): each path's output verifies
with the same verifiers as files do."""

from __future__ import annotations

import ctypes
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import DATA_DIR
from helpers import MILAN_REPORT as REPORT
from helpers import MILAN_VCEK as VCEK

from gputravel.core.attestation.hardware_snp import (
    SNP_GET_REPORT,
    SnpGuestRequest,
    SnpReportReq,
    TpmTransport,
    azure_evidence_from_vtpm,
    parse_cert_table,
    read_snp_tsm_report,
    snp_report_from_configfs,
    snp_report_from_sev_guest,
)
from gputravel.core.errors import AttestationError
from gputravel.core.evidence.azure_snp import ak_from_pem, parse_hcl_report, parse_tpm_quote, verify_tpm_quote
from gputravel.core.evidence.snp import verify_snp_report

SNP = DATA_DIR / "amd-snp"
AZ = DATA_DIR / "azure-vtpm"
REPORT_DATA = REPORT[0x50:0x90]
VCEK_GUID = uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd")


def _cert_table(**certs: bytes) -> bytes:
    guids = {"vcek": VCEK_GUID, "ask": uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782")}
    head = 24 * (len(certs) + 1)
    entries, blobs = b"", b""
    for name, der in certs.items():
        entries += guids[name].bytes_le + struct.pack("<II", head + len(blobs), len(der))
        blobs += der
    return entries + bytes(24) + blobs


def _tsm_entry(tmp_path: Path, provider: str = "sev_guest", aux: bytes | None = None) -> Path:
    entry = tmp_path / "entry"
    entry.mkdir(parents=True)
    (entry / "provider").write_text(provider + "\n")
    (entry / "generation").write_text("1\n")
    (entry / "outblob").write_bytes(REPORT)
    if aux is not None:
        (entry / "auxblob").write_bytes(aux)
    return entry


def test_a_recorded_tsm_entry_yields_the_report_and_the_hosts_vcek_which_verify(tmp_path: Path) -> None:
    report, certs = read_snp_tsm_report(_tsm_entry(tmp_path, aux=_cert_table(vcek=VCEK)), REPORT_DATA)
    assert certs == {"vcek": VCEK}
    assert verify_snp_report(report, certs["vcek"]).ok


def test_a_tsm_entry_of_another_provider_or_report_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AttestationError, match="not an SEV-SNP guest"):
        read_snp_tsm_report(_tsm_entry(tmp_path / "a", provider="tdx_guest"), REPORT_DATA)
    with pytest.raises(AttestationError, match="other report data"):
        read_snp_tsm_report(_tsm_entry(tmp_path / "b"), bytes(64))


def test_outside_an_snp_guest_configfs_tsm_is_missing_and_says_so(tmp_path: Path) -> None:
    with pytest.raises(AttestationError, match="configfs-tsm"):
        snp_report_from_configfs(bytes(64), root=tmp_path / "none")


def test_a_cert_table_entry_past_its_end_is_refused() -> None:
    bad = VCEK_GUID.bytes_le + struct.pack("<II", 48, 10_000) + bytes(24)
    with pytest.raises(AttestationError, match="past its end"):
        parse_cert_table(bad)


class RecordedSevGuest:
    """Answers SNP_GET_REPORT as the sev-guest driver does, with a report recorded for one report data."""

    def __init__(self, report: bytes, *, status: int = 0) -> None:
        self.report, self.status = report, status
        self.asked: list[bytes] = []

    def __call__(self, fd: int, request: int, arg: Any) -> int:
        assert request == SNP_GET_REPORT and isinstance(arg, SnpGuestRequest) and arg.msg_version == 1
        req = SnpReportReq.from_address(arg.req_data)
        self.asked.append(bytes(req.user_data))
        rsp = struct.pack("<II", self.status, len(self.report)) + bytes(24) + self.report
        ctypes.memmove(arg.resp_data, rsp, len(rsp))
        return 0


def test_a_recorded_sev_guest_answer_is_read_and_verifies(tmp_path: Path) -> None:
    device = tmp_path / "sev-guest"
    device.write_bytes(b"")
    recorded = RecordedSevGuest(REPORT)
    report = snp_report_from_sev_guest(REPORT_DATA, device=str(device), ioctl=recorded)
    assert recorded.asked == [REPORT_DATA]
    assert verify_snp_report(report, VCEK).ok
    with pytest.raises(AttestationError, match="other report data"):
        snp_report_from_sev_guest(bytes(64), device=str(device), ioctl=recorded)
    with pytest.raises(AttestationError, match="status 0x16"):
        snp_report_from_sev_guest(REPORT_DATA, device=str(device), ioctl=RecordedSevGuest(REPORT, status=0x16))
    with pytest.raises(AttestationError, match="no SEV-SNP guest device"):
        snp_report_from_sev_guest(REPORT_DATA, device=str(tmp_path / "missing"))


class RecordedVtpm(TpmTransport):
    """A vTPM that answers NV_ReadPublic, NV_Read and Quote with Azure's recorded HCL report and quote (and only
    for the nonce the quote was recorded with)."""

    def __init__(self) -> None:
        super().__init__("recorded")
        self.hcl = (AZ / "hcl-report-snp.bin").read_bytes()
        raw = (AZ / "quote.bin").read_bytes()
        n = struct.unpack_from("<Q", raw, 0)[0]
        self.signature = raw[8:8 + n]
        m = struct.unpack_from("<Q", raw, 8 + n)[0]
        self.attest = raw[16 + n:16 + n + m]
        self.codes: list[int] = []

    @staticmethod
    def _ok(body: bytes) -> bytes:
        return struct.pack(">HII", 0x8001, 10 + len(body), 0) + body

    def transmit(self, command: bytes) -> bytes:
        tag, size, code = struct.unpack_from(">HII", command, 0)
        assert size == len(command)
        self.codes.append(code)
        if code == 0x169:  # NV_ReadPublic: TPM2B_NV_PUBLIC (empty policy), then a name
            public = struct.pack(">IHIHH", 0x01400001, 0x000B, 0, 0, len(self.hcl))
            return self._ok(struct.pack(">H", len(public)) + public + struct.pack(">H", 0))
        if code == 0x14E:  # NV_Read: size, offset after the handles and the session area
            n, offset = struct.unpack_from(">HH", command, 10 + 8 + 13)
            chunk = self.hcl[offset:offset + n]
            return self._ok(struct.pack(">IH", 2 + len(chunk), len(chunk)) + chunk)
        if code == 0x158:  # Quote: qualifyingData after the handle and the session area
            (qlen,) = struct.unpack_from(">H", command, 10 + 4 + 13)
            nonce = command[10 + 4 + 13 + 2:10 + 4 + 13 + 2 + qlen]
            if nonce != b"challenge":
                return struct.pack(">HII", 0x8001, 10, 0x101)  # what a recording cannot answer
            body = (struct.pack(">H", len(self.attest)) + self.attest
                    + struct.pack(">HHH", 0x0014, 0x000B, len(self.signature)) + self.signature)
            return self._ok(struct.pack(">I", len(body)) + body)
        raise AssertionError(f"unexpected TPM command {code:#x}")


def test_a_recorded_vtpm_yields_the_hcl_report_and_a_quote_that_verifies() -> None:
    tpm = RecordedVtpm()
    evidence = azure_evidence_from_vtpm(b"challenge", tpm=tpm)
    assert evidence.hcl_report == tpm.hcl and tpm.codes[0] == 0x169 and tpm.codes[-1] == 0x158
    assert parse_hcl_report(evidence.hcl_report).hash_type == 1
    quote = parse_tpm_quote(evidence.quote)
    assert verify_tpm_quote(quote, ak_from_pem((AZ / "akpub.pub").read_bytes()), b"challenge") == ("", "")


def test_a_vtpm_error_is_named() -> None:
    with pytest.raises(AttestationError, match="Quote failed"):
        azure_evidence_from_vtpm(b"another nonce", tpm=RecordedVtpm())
