"""A holder's check of an SEV-SNP orchestrator CVM (issue 31 item 2): the same ATTEST fields as a TDX CVM's.

The CVM's evidence travels as ``quote`` and ``collateral`` whatever its kind, so the wire is unchanged:

* ``tdx``: a TDX quote and dcap-qvl's collateral JSON (:mod:`.tdx`).
* ``snp``: the raw SNP report (1,184 bytes) whose report_data is ``keywrap.cvm_report_data(link key, run id)``,
  and ``{"kind": "snp", "vcek": PEM}``.
* ``azure-snp``: Azure's HCL report, and ``{"kind": "azure-snp", "vcek": PEM, "tpm_quote": hex}``: a TPM2 quote
  by the report's vTPM key ``HCLAkPub`` whose extraData is that same report data (so the quote, made for this run
  and key, is what binds them; the HCL report binds the key to the chip).

:func:`cvm_kind` reads the kind from the collateral (TDX's JSON has no ``kind``). The result has the keys the
TDX check returns (``ok``, ``tcb_status``, ``mr_td``: the launch measurement, ``failed``); a report data that is
not the expected one fails ``report-data-binding`` in every kind. Verdicts on the report and chain are kept,
content-addressed, until the VCEK's end.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from cryptography import x509

from .azure_snp import verify_azure_snp
from .policy import SnpPolicy
from .snp import SnpVerdict, verify_snp_report

__all__ = ["CVM_KINDS", "check_snp_cvm", "cvm_kind", "snp_collateral"]

CVM_KINDS = ("tdx", "snp", "azure-snp")
REPORT_DATA_CLAIM = "report-data-binding"
_CACHE: OrderedDict[tuple[bytes, SnpPolicy], tuple[float, SnpVerdict]] = OrderedDict()
_CACHE_SIZE = 16


def snp_collateral(kind: str, vcek_pem: bytes, *, tpm_quote: bytes | None = None) -> bytes:
    """The ``collateral`` an SNP CVM sends beside its report (its VCEK; Azure's also the TPM quote)."""
    if kind not in ("snp", "azure-snp") or (kind == "azure-snp") != (tpm_quote is not None):
        raise ValueError(f"collateral of kind {kind!r}: snp takes a VCEK, azure-snp a VCEK and a TPM quote")
    doc: dict[str, str] = {"kind": kind, "vcek": vcek_pem.decode("ascii")}
    if tpm_quote is not None:
        doc["tpm_quote"] = tpm_quote.hex()
    return json.dumps(doc).encode()


def cvm_kind(collateral: bytes) -> str:
    """``snp`` or ``azure-snp`` when the collateral says so, else ``tdx``."""
    if not collateral.lstrip().startswith(b"{") or b'"kind"' not in collateral[:64]:
        return "tdx"
    try:
        kind = json.loads(collateral).get("kind")
    except (ValueError, AttributeError):
        return "tdx"
    return str(kind) if kind in ("snp", "azure-snp") else "tdx"


def _tcb_status(verdict: SnpVerdict) -> str | None:
    tcb = verdict.to_json()["reported_tcb"]
    if not tcb:
        return None
    short = {"boot_loader": "bl", "tee": "tee", "snp": "snp", "microcode": "uc", "fmc": "fmc"}
    return f"SNP {verdict.product} " + " ".join(f"{short[k]}{v}" for k, v in tcb.items())  # at most 64 chars


def check_snp_cvm(quote: bytes, collateral: bytes, expected_report_data: bytes, policy: SnpPolicy, *,
                  now: int | None = None) -> dict[str, Any]:
    """``{"ok", "tcb_status", "mr_td", "failed"}`` for an SNP or Azure SNP CVM's evidence; never raises."""
    try:
        doc = json.loads(collateral)
        kind, vcek = str(doc["kind"]), str(doc["vcek"]).encode("ascii")
        tpm_quote = bytes.fromhex(str(doc["tpm_quote"])) if kind == "azure-snp" else b""
    except (ValueError, KeyError, TypeError, UnicodeEncodeError):
        return {"ok": False, "tcb_status": None, "mr_td": None, "failed": "collateral-parsed"}
    at = int(time.time()) if now is None else now
    tag = (hashlib.sha256(kind.encode() + b"\0" + quote + b"\0" + collateral + b"\0" + expected_report_data).digest(),
           policy)
    hit = _CACHE.get(tag)
    verdict = hit[1] if hit is not None and at < hit[0] else None
    if verdict is None:
        if kind == "azure-snp":  # the TPM quote's extraData must be the expected report data: the binding
            verdict = verify_azure_snp(quote, vcek, tpm_quote, expected_report_data, now=now, policy=policy)
        else:
            verdict = verify_snp_report(quote, vcek, now=now, policy=policy)
        if verdict.ok:  # kept until the VCEK's end, and the policy's CRL's next update
            _CACHE[tag] = (min(_vcek_end(vcek), _crl_end(policy)), verdict)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    report = verdict.report
    mr = report.measurement.hex() if report is not None else None
    failed = verdict.failed
    if failed == "tpm-nonce-match":
        failed = REPORT_DATA_CLAIM
    if failed is None and kind == "snp" and report is not None and report.report_data != expected_report_data:
        failed = REPORT_DATA_CLAIM
    return {"ok": failed is None, "tcb_status": _tcb_status(verdict), "mr_td": mr, "failed": failed}


def _crl_end(policy: SnpPolicy) -> float:
    if policy.crl is None:
        return float("inf")
    try:
        data = policy.crl.read_bytes()
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN X509 CRL-----" in data else x509.load_der_x509_crl(data)
        return crl.next_update_utc.timestamp() if crl.next_update_utc is not None else time.time()
    except (OSError, ValueError):
        return time.time()


def _vcek_end(vcek: bytes) -> float:
    from .snp import load_certificate

    try:
        return load_certificate(vcek).not_valid_after_utc.timestamp()
    except ValueError:
        return time.time()
