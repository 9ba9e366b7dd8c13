"""TDX quotes of one quoting enclave under one collateral, checked in full once per agreement (issue 36).

A TD's quote is its TD report (header and body) signed by its platform's quoting enclave (QE) with the QE's
attestation key; everything after that signature (the attestation key, the QE report binding it, the QE report's
signature by the PCK key, the QE authentication data and the PCK certificate chain) is the QE's own and the same in
every quote it makes. dcap-qvl re-checks all of it, and the collateral (CRLs, TCB info, QE identity, their chains to
the pinned root), for every quote: ~1.4 ms of CPU each, most of the fleet-key agreement, where W workers each verify
W - 1 quotes, many from one platform.

:class:`TdxQuoteFamilies` checks the first quote of a *family* with dcap-qvl and the policy, in full. A later quote
is of the same family when every byte of it and of its collateral equals that first quote's, except two: the TD's
``REPORTDATA`` (what the quote binds: the agreement's key and context) and the quote's ECDSA signature. Such a quote
gets its own signature verified (ECDSA P-256 over its header and TD report, under the attestation key the first
check proved the QE certified) and the first quote's verdict with its own report data, which the caller then
compares with what it expects. Every other byte the first check judged (TD attributes, MRTD, RTMRs, TCB SVNs, the
QE and PCK data, the collateral) is identical, so no check is skipped, only repeated work; a quote that differs
anywhere else (a debuggable TD, another MRTD, another QE, tampered bytes) is not of the family and gets dcap-qvl in
full. A family is kept only while its collateral is valid (its dates are read on the first reuse, not on a quote
seen once), and only for the checker's lifetime: one agreement.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from .tdx import HEADER_LEN, TD_REPORT10_LEN, TdxVerdict, quote_extent_problem

__all__ = ["REPORT_DATA_AT", "SIGNATURE_AT", "TdxQuoteFamilies", "collateral_expiry", "family_tag"]

#: TD report 1.0's REPORTDATA: after TEE_TCB_SVN (16), MRSEAM, MRSIGNERSEAM (48 each), SEAM/TD attributes and XFAM
#: (8 each), MRTD, MRCONFIGID, MROWNER, MROWNERCONFIG (48 each) and RTMR0-3 (4 x 48): 520 bytes into the body
REPORT_DATA_AT = HEADER_LEN + 520
SIGNED_LEN = HEADER_LEN + TD_REPORT10_LEN
#: the quote's signature (r || s) after the signature data's u32 length; the attestation key (x || y) after it
SIGNATURE_AT = SIGNED_LEN + 4
ATTESTATION_KEY_AT = SIGNATURE_AT + 64


def _when(text: object) -> float:
    return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


def collateral_expiry(collateral: bytes) -> float:
    """The first moment (Unix seconds) at which any part of a TDX collateral stops being valid: the TCB info's
    and QE identity's ``nextUpdate``, the CRLs' next updates, the issuer chains' certificates. A cached verdict
    on it must not outlive that (issue 30); a collateral whose dates cannot be read expires now."""
    try:
        doc = json.loads(collateral)
        ends = [_when(json.loads(doc[k])["nextUpdate"]) for k in ("tcb_info", "qe_identity")]
        for k in ("pck_crl", "root_ca_crl"):
            crl = x509.load_der_x509_crl(bytes.fromhex(doc[k]))
            if crl.next_update_utc is not None:
                ends.append(crl.next_update_utc.timestamp())
        for k in ("pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain"):
            ends += [c.not_valid_after_utc.timestamp() for c in x509.load_pem_x509_certificates(doc[k].encode())]
        return min(ends)
    except (ValueError, KeyError, TypeError, AttributeError):
        return time.time()


def family_tag(quote: bytes, collateral: bytes) -> bytes:
    """SHA-256 over the quote and collateral, less the quote's REPORTDATA and signature (lengths fixed, so the
    parts cannot shift): equal tags, equal bytes everywhere else."""
    h = hashlib.sha256()
    for part in (quote[:REPORT_DATA_AT], quote[REPORT_DATA_AT + 64:SIGNATURE_AT], quote[ATTESTATION_KEY_AT:],
                 collateral):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.digest()


def _signature_holds(quote: bytes) -> bool:
    """The quote's ECDSA P-256 signature over its header and TD report, under the attestation key it carries."""
    try:
        key = ec.EllipticCurvePublicKey.from_encoded_point(
            ec.SECP256R1(), b"\x04" + quote[ATTESTATION_KEY_AT:ATTESTATION_KEY_AT + 64])
        sig = quote[SIGNATURE_AT:SIGNATURE_AT + 64]
        key.verify(encode_dss_signature(int.from_bytes(sig[:32], "big"), int.from_bytes(sig[32:], "big")),
                   quote[:SIGNED_LEN], ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass(slots=True)
class _Family:
    verdict: TdxVerdict
    collateral: bytes
    at: float  # when its first quote was checked: a reuse is never earlier (the collateral's start)
    expires: float | None = None  # read on the first reuse


@dataclass(slots=True)
class TdxQuoteFamilies:
    """One checker's families (one agreement's): ``verify`` gives the verdict ``verify_tdx_quote`` would give."""

    #: off: every quote checked in full (a benchmark's baseline), counted the same way
    reuse: bool = True
    _known: dict[bytes, _Family] = field(default_factory=dict)
    #: quotes checked by dcap-qvl in full, and quotes of a known family (their signature alone checked afresh)
    full: int = 0
    reused: int = 0

    def verify(self, quote: bytes, collateral: bytes, at: float, full: Callable[[], TdxVerdict]) -> TdxVerdict:
        """``full()`` (dcap-qvl and the policy) for a quote of no known family; for one of a family whose first
        quote passed, its own signature and then that verdict with its own report data."""
        if not self.reuse or quote_extent_problem(quote):  # not exactly one v4 quote: dcap-qvl's refusal, named as ever
            self.full += 1
            return full()
        tag = family_tag(quote, collateral)
        known = self._known.get(tag)
        if known is not None:
            if known.expires is None:
                known.expires = collateral_expiry(known.collateral)
            if known.at <= at < min(known.expires, known.verdict.age_limit or float("inf")):
                self.reused += 1
                if not _signature_holds(quote):
                    return TdxVerdict(ok=False, failed="quote-verified", checks={"quote-parsed": True,
                                                                                 "collateral-parsed": True,
                                                                                 "quote-verified": False},
                                      reason="the quote's signature does not verify under its attestation key")
                report_data = quote[REPORT_DATA_AT:REPORT_DATA_AT + 64].hex()
                return replace(known.verdict, report_data=report_data)
            del self._known[tag]
        self.full += 1
        verdict = full()
        if verdict.ok:  # a refusal is not kept: the next quote is checked in full
            self._known[tag] = _Family(verdict, collateral, at)
        return verdict
