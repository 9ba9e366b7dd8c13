"""An NVIDIA GPU's SPDM evidence judged: the claims (NVIDIA's claims-3.0 names) a report and its certificate chain
make under a requester's nonce (:func:`verify_report`), the certificate-chain claim (:func:`add_cert_chain_claim`,
shared with the RIM's), the per-visit check once the chain was checked for the run (:func:`check_fresh_report`)
and the comparison with golden measurements (:func:`compare_measurements`). The report's format and the
certificates are ``nvidia_spdm``. Standard library and cryptography only (holders run it)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from cryptography import x509

from .claims import NOT_CHECKED, ClaimSet
from .nvidia_spdm import (
    ARCH_BY_CHIP_PREFIX,
    CHAIN_LENGTH,
    NVDEC0_DISABLED,
    OPAQUE_CHIP_INFO,
    OPAQUE_NVDEC0_STATUS,
    EvidenceFormatError,
    GpuReport,
    check_chain,
    device_root,
    hwmodel_of,
    leaf_fwid,
    load_pem_chain,
    parse_report,
    read_hex_or_raw,
    signature_ok,
)

__all__ = ["add_cert_chain_claim", "check_fresh_report", "compare_measurements", "verify_report"]


def verify_report(raw: bytes, chain_pem: bytes, nonce: bytes, *, root: x509.Certificate | None = None,
                  at: dt.datetime | None = None, chain_length: int | None = CHAIN_LENGTH,
                  expected_arch: Sequence[str] = ("HOPPER",), claims: ClaimSet | None = None) -> tuple[ClaimSet, GpuReport | None]:
    """Check one GPU's evidence under the requester's ``nonce``; never raises on bad evidence.

    Claims, in order: report parsed, cert chain validated (to ``root``, default NVIDIA's), FWID match, OCSP
    (not checked: offline), nonce match, signature verified, arch check, driver and VBIOS versions, hwmodel, ueid.
    """
    out = claims if claims is not None else ClaimSet()
    at = at or dt.datetime.now(dt.UTC)
    p = "x-nvidia-gpu-attestation-report"
    try:
        report = parse_report(read_hex_or_raw(raw))
    except EvidenceFormatError as exc:
        out.add(f"{p}-parsed", False, False, str(exc))
        return out, None
    out.add(f"{p}-parsed", True, True, f"{len(report.blocks)} measurement blocks, {len(report.opaque)} opaque fields")
    try:
        chain: list[x509.Certificate] = load_pem_chain(chain_pem)
        why = check_chain(chain, root or device_root(), at=at, length=chain_length)
    except EvidenceFormatError as exc:
        chain, why = [], str(exc)
    add_cert_chain_claim(out, f"{p}-cert-chain", chain, why, at=at)
    try:
        cert_fwid = leaf_fwid(chain[0]) if chain else None
    except EvidenceFormatError as exc:
        cert_fwid, fwid_why = None, str(exc)
    else:
        fwid_why = ""
    if not report.fwid:  # as NVIDIA's verifier: a report without FWID skips the comparison
        out.add(f"{p}-cert-chain-fwid-match", True, True, "the report carries no FWID")
    else:
        match = cert_fwid == report.fwid
        out.add(f"{p}-cert-chain-fwid-match", match, match,
                f"report {report.fwid.hex()[:16]}..., leaf {cert_fwid.hex()[:16] + '...' if cert_fwid else fwid_why or 'none'}")
    nonce_ok = report.nonce == nonce
    out.add(f"{p}-nonce-match", nonce_ok, nonce_ok,
            "" if nonce_ok else f"report {report.nonce.hex()}, expected {nonce.hex()}")
    sig_ok = bool(chain) and signature_ok(report, chain[0])
    out.add(f"{p}-signature-verified", sig_ok, sig_ok,
            "ECDSA P-384/SHA-384 over request + response" if sig_ok else "the signature does not verify with the leaf")
    hwmodel = hwmodel_of(chain)
    chip = report.opaque.get(OPAQUE_CHIP_INFO, b"").split(b"\0", 1)[0].decode("ascii", "replace") or hwmodel
    arch = next((a for pre, a in ARCH_BY_CHIP_PREFIX.items() if chip.startswith(pre)), "")
    arch_ok = arch in expected_arch
    out.add("x-nvidia-gpu-arch-check", arch_ok, arch_ok,
            f"{arch or 'unknown'} from {chip!r}, expected {'/'.join(expected_arch)}")
    out.add("x-nvidia-gpu-driver-version", report.driver_version, bool(report.driver_version))
    out.add("x-nvidia-gpu-vbios-version", report.vbios_version.upper(), bool(report.vbios_version))  # NVIDIA's case
    out.add("hwmodel", hwmodel, None, "common name of the certificate above the leaf")
    out.add("ueid", str(chain[0].serial_number) if chain else "", None, "serial number of the leaf certificate")
    return out, report


def add_cert_chain_claim(out: ClaimSet, name: str, chain: Sequence[x509.Certificate], why: str | None, *,
                         at: dt.datetime) -> None:
    """NVIDIA's claims-3.0 certificate-chain claim: ``{x-nvidia-cert-expiration-date, -cert-status, -cert-ocsp-status,
    -cert-revocation-reason}``; ``ok`` is False for a bad chain, None for a good one whose revocation (OCSP) was not
    checked (offline: the policy's ``accept_ocsp_not_checked`` decides)."""
    earliest = min((c.not_valid_after_utc for c in chain), default=None)
    expired = why is not None and earliest is not None and at > earliest and "not valid at" in why
    status = "valid" if why is None else "expired" if expired else "invalid"
    value = {"x-nvidia-cert-expiration-date": earliest.replace(tzinfo=None).isoformat() if earliest else None,
             "x-nvidia-cert-status": status, "x-nvidia-cert-ocsp-status": NOT_CHECKED,
             "x-nvidia-cert-revocation-reason": None}
    detail = why or f"{len(chain)} certificates to the pinned root; revocation (OCSP) needs NVIDIA's service: offline"
    out.add(name, value, False if why else None, detail)


def check_fresh_report(raw: bytes, leaf: x509.Certificate, nonce: bytes) -> tuple[str | None, GpuReport | None]:
    """The per-visit part, once the chain (and its leaf) were checked for the run: parse, nonce, signature.

    Returns ``(None, report)`` when they hold, else ``(failed claim name, report or None)``; never raises.
    """
    p = "x-nvidia-gpu-attestation-report"
    try:
        report = parse_report(read_hex_or_raw(raw))
    except EvidenceFormatError:
        return f"{p}-parsed", None
    if report.nonce != nonce:
        return f"{p}-nonce-match", report
    if not signature_ok(report, leaf):
        return f"{p}-signature-verified", report
    return None, report


def compare_measurements(report: GpuReport, golden: Mapping[int, Sequence[bytes]]) -> list[int]:
    """RIM indices whose runtime value matches none of the golden alternatives (empty: all match).

    ``golden`` maps NVIDIA's RIM index (from 0) to the allowed values of that measurement (active ones only).
    Index 35 is skipped when the report says NVDEC0 is disabled (as NVIDIA's verifier intends).
    """
    nvdec_off = report.opaque.get(OPAQUE_NVDEC0_STATUS) == bytes([NVDEC0_DISABLED])
    bad = []
    for index in sorted(golden):
        if index == 35 and nvdec_off:
            continue
        value = report.measurement(index)
        if value is None or value not in golden[index]:
            bad.append(index)
    return bad
