"""OCSP for NVIDIA's certificate chains (issue 31 item 3), as NVIDIA's verifier asks: one request per certificate
below the root, with a fresh nonce, to NVIDIA's OCSP service (``https://ocsp.ndis.nvidia.com``).

An answer counts only when it is ``successful``, signed by the certificate's issuer (or by a responder the issuer
certified for OCSP signing), echoes the nonce, and is current (``this_update <= at <= next_update``). The chain's
result is claims 3.0's ``x-nvidia-cert-ocsp-status`` (``good``, ``revoked``, ``unknown``) with
``x-nvidia-cert-revocation-reason``; a bad answer is named in the detail. Standard library and ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.padding import PKCS1v15
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

from .bounded import EVIDENCE_CAP

__all__ = ["NVIDIA_OCSP_URL", "OcspResult", "check_chain_ocsp", "http_post"]

NVIDIA_OCSP_URL = "https://ocsp.ndis.nvidia.com"
Post = Callable[[str, bytes], bytes]


@dataclass(frozen=True, slots=True)
class OcspResult:
    status: str  # "good", "revoked", "unknown", or "error" (no usable answer)
    reason: str | None = None  # the revocation reason, as NVIDIA names it (e.g. "key_compromise")
    detail: str = ""


def http_post(url: str, body: bytes) -> bytes:
    """POST an OCSP request; the answer's body (capped).

    Raises:
        OSError: unreachable or an HTTP error.
    """
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/ocsp-request"})
    try:
        with urllib.request.urlopen(req, timeout=20.0) as resp:
            return bytes(resp.read(EVIDENCE_CAP))
    except urllib.error.HTTPError as exc:
        raise OSError(f"{url}: HTTP {exc.code}") from None


def _signed_by(resp: ocsp.OCSPResponse, issuer: x509.Certificate, at: dt.datetime) -> str:
    """'' when the response is signed by ``issuer`` or a responder ``issuer`` certified for OCSP signing."""
    signer = issuer
    if resp.certificates:
        responder = resp.certificates[0]
        if responder != issuer:
            try:
                responder.verify_directly_issued_by(issuer)
                eku = responder.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
                return "the responder certificate is not one the issuer certified for OCSP signing"
            if ExtendedKeyUsageOID.OCSP_SIGNING not in eku:
                return "the responder certificate may not sign OCSP answers"
            if not responder.not_valid_before_utc <= at <= responder.not_valid_after_utc:
                return "the responder certificate is not valid now"
            signer = responder
    key = signer.public_key()
    algorithm = resp.signature_hash_algorithm
    try:
        if algorithm is None:
            raise InvalidSignature
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(resp.signature, resp.tbs_response_bytes, ec.ECDSA(algorithm))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(resp.signature, resp.tbs_response_bytes, PKCS1v15(), algorithm)
        else:
            raise InvalidSignature
    except InvalidSignature:
        return "the answer's signature does not verify"
    return ""


def _one(cert: x509.Certificate, issuer: x509.Certificate, url: str, post: Post, at: dt.datetime) -> OcspResult:
    nonce = os.urandom(32)
    request = (ocsp.OCSPRequestBuilder().add_certificate(cert, issuer, hashes.SHA384())
               .add_extension(x509.OCSPNonce(nonce), critical=False).build())
    try:
        resp = ocsp.load_der_ocsp_response(post(url, request.public_bytes(Encoding.DER)))
    except (OSError, ValueError) as exc:
        return OcspResult("error", detail=f"no OCSP answer for {cert.subject.rfc4514_string()}: {exc}")
    if resp.response_status != ocsp.OCSPResponseStatus.SUCCESSFUL:
        return OcspResult("error", detail=f"the OCSP service answered {resp.response_status.name}")
    why = _signed_by(resp, issuer, at)
    if why:
        return OcspResult("error", detail=why)
    try:
        echoed = resp.extensions.get_extension_for_class(x509.OCSPNonce).value.nonce
    except x509.ExtensionNotFound:
        echoed = b""
    if echoed != nonce:
        return OcspResult("error", detail="the OCSP answer does not echo this request's nonce (a replay?)")
    if resp.serial_number != cert.serial_number:
        return OcspResult("error", detail="the OCSP answer is for another certificate")
    if not resp.this_update_utc <= at or (resp.next_update_utc is not None and at > resp.next_update_utc):
        return OcspResult("error", detail="the OCSP answer is not current")
    if resp.certificate_status == ocsp.OCSPCertStatus.REVOKED:
        reason = resp.revocation_reason.name if resp.revocation_reason is not None else "unspecified"
        return OcspResult("revoked", reason, f"{cert.subject.rfc4514_string()} is revoked ({reason})")
    if resp.certificate_status == ocsp.OCSPCertStatus.UNKNOWN:
        return OcspResult("unknown", detail=f"the OCSP service does not know {cert.subject.rfc4514_string()}")
    return OcspResult("good")


def check_chain_ocsp(chain: Sequence[x509.Certificate], url: str = NVIDIA_OCSP_URL, *, post: Post = http_post,
                     at: dt.datetime | None = None) -> OcspResult:
    """The chain's OCSP result (leaf first, root last; the root is not asked about): the first certificate that
    is not ``good`` decides."""
    at = at or dt.datetime.now(dt.UTC)
    for cert, issuer in zip(chain[:-1], chain[1:], strict=False):
        result = _one(cert, issuer, url, post, at)
        if result.status != "good":
            return result
    return OcspResult("good", detail=f"{max(len(chain) - 1, 0)} certificates good by OCSP")
