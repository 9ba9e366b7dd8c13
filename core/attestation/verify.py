"""The verifier: one check per claim, run over a table, and the result they add up to.

Each check reads a ``VerifyContext`` (the evidence parsed once, plus the verifier's nonce, pinned
root, revocation list, policy and clock) and returns the detail of its claim or raises
``ClaimFailed``. ``verify_evidence`` runs ``CHECKS`` in order and adds ``overall``. Verification
fails closed: bad evidence yields false claims, never an exception. What it yields (``Claim``,
``AttestationResult``, ``AttestationToken``) is ``result``'s, re-exported here.
"""

from __future__ import annotations

import datetime as dt
import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.core.attestation.evidence import (
    PLATFORM_EMULATED,
    Evidence,
    Report,
    canonical_json,
    sha256_hex,
)
from gputravel.core.attestation.pki import SIG_HASH, common_name, ec_public, public_key_fingerprint
from gputravel.core.attestation.policy import Policy
from gputravel.core.attestation.result import AttestationResult, AttestationToken, Claim
from gputravel.core.errors import AttestationError

__all__ = [
    "CHECKS",
    "CLAIM_NAMES",
    "MAX_CLOCK_SKEW_S",
    "AttestationResult",
    "AttestationToken",
    "Claim",
    "ClaimCheck",
    "ClaimFailed",
    "VerifyContext",
    "check_chain",
    "check_measurements",
    "check_mode",
    "check_nonce",
    "check_revocation",
    "check_signature",
    "verify_context",
    "verify_evidence",
]

MAX_CLOCK_SKEW_S = 30.0
"""How far in the future a report timestamp may lie before the nonce claim fails."""

_CERT_ROLES = ("device certificate", "device CA", "vendor root")


# --- what every check reads ------------------------------------------------------------------------
class ClaimFailed(Exception):
    """A claim failed for a stated reason (the claim's detail)."""


@dataclass(frozen=True, slots=True)
class VerifyContext:
    """The evidence parsed once, and the verifier's inputs; checks read it, none changes it.

    ``chain`` is empty and ``report`` None when they did not parse; ``need_chain``/``need_report``
    then fail the asking claim with the parse error.
    """

    evidence: Evidence
    nonce: bytes
    root: x509.Certificate
    crl: x509.CertificateRevocationList | None
    policy: Policy
    now: float
    when: dt.datetime
    expected_code: str | None
    chain: tuple[x509.Certificate, ...]
    chain_error: str
    report: Report | None
    report_error: str

    def need_chain(self) -> tuple[x509.Certificate, ...]:
        if not self.chain:
            raise ClaimFailed(self.chain_error)
        return self.chain

    def need_report(self) -> Report:
        if self.report is None:
            raise ClaimFailed(self.report_error)
        return self.report


def _parse_chain(chain_pem: tuple[bytes, ...]) -> tuple[tuple[x509.Certificate, ...], str]:
    """(leaf, device CA, root) and no error, or nothing and why."""
    if len(chain_pem) != 3:
        return (), f"expected 3 certificates (leaf, device CA, root), got {len(chain_pem)}"
    try:
        return tuple(x509.load_pem_x509_certificate(p) for p in chain_pem), ""
    except (ValueError, TypeError):
        return (), "a certificate in the chain is not valid PEM"
    except Exception as exc:  # fail closed on anything unexpected
        return (), f"chain unreadable: {type(exc).__name__}"


def _parse_report(report: bytes) -> tuple[Report | None, str]:
    """The report and no error, or None and why."""
    try:
        return Report.parse(report), ""
    except AttestationError as exc:
        return None, exc.reason
    except Exception as exc:  # fail closed on anything unexpected
        return None, f"report unreadable: {type(exc).__name__}"


def verify_context(
    evidence: Evidence,
    *,
    nonce: bytes,
    root: x509.Certificate,
    crl: x509.CertificateRevocationList | None,
    policy: Policy,
    now: float | None = None,
    expected_code: str | None = None,
) -> VerifyContext:
    """Parse the evidence's chain and report once; never raises for bad evidence."""
    now = time.time() if now is None else now
    when = dt.datetime.fromtimestamp(now, dt.UTC)
    chain: tuple[x509.Certificate, ...] = ()
    try:
        chain_pem = tuple(evidence.chain_pem)
    except Exception as exc:  # fail closed on anything unexpected
        chain_error = f"chain unreadable: {type(exc).__name__}"
    else:
        chain, chain_error = _parse_chain(chain_pem)
    report, report_error = _parse_report(evidence.report)
    return VerifyContext(
        evidence=evidence, nonce=nonce, root=root, crl=crl, policy=policy,
        now=now, when=when, expected_code=expected_code,
        chain=chain, chain_error=chain_error, report=report, report_error=report_error,
    )


# --- one check per claim ---------------------------------------------------------------------------
def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def _require_ca(cert: x509.Certificate, what: str) -> None:
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise ClaimFailed(f"{what} has no basicConstraints") from None
    if not bc.ca:
        raise ClaimFailed(f"{what} is not a CA")
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not ku.key_cert_sign:
        raise ClaimFailed(f"{what} may not sign certificates")


def _require_signed_links(leaf: x509.Certificate, inter: x509.Certificate, root: x509.Certificate) -> None:
    try:
        leaf.verify_directly_issued_by(inter)
    except (ValueError, TypeError, InvalidSignature):
        raise ClaimFailed("device certificate is not signed by the device CA") from None
    try:
        inter.verify_directly_issued_by(root)
        root.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        raise ClaimFailed("device CA is not signed by the pinned vendor root") from None


def _require_leaf(leaf: x509.Certificate) -> None:
    try:
        if leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ClaimFailed("device certificate is a CA")
    except x509.ExtensionNotFound:
        pass
    try:
        ec_public(leaf)
    except ValueError:
        raise ClaimFailed("device key is not P-384") from None


def check_chain(ctx: VerifyContext) -> str:
    """Device certificate -> device CA -> the pinned root, each valid now, with CA/leaf constraints."""
    leaf, inter, top = ctx.need_chain()
    root, when = ctx.root, ctx.when
    if _der(top) != _der(root):
        raise ClaimFailed("chain does not end at the pinned vendor root")
    _require_signed_links(leaf, inter, root)
    for cert, what in zip((leaf, inter, root), _CERT_ROLES, strict=True):
        if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
            raise ClaimFailed(f"{what} is not valid at {when:%Y-%m-%dT%H:%M:%SZ}")
    _require_ca(inter, "device CA")
    _require_ca(root, "vendor root")
    _require_leaf(leaf)
    return f"device certificate -> device CA -> pinned root {public_key_fingerprint(ec_public(root))}"


def check_revocation(ctx: VerifyContext) -> str:
    """A current revocation list signed by the pinned root names none of the chain's certificates."""
    certs, crl, root = ctx.need_chain(), ctx.crl, ctx.root
    if crl is None:
        raise ClaimFailed("no revocation list available")
    if crl.issuer != root.subject or not crl.is_signature_valid(ec_public(root)):
        raise ClaimFailed("revocation list is not signed by the pinned root")
    next_update = crl.next_update_utc
    if next_update is not None and next_update < ctx.when:
        raise ClaimFailed("revocation list is out of date")
    for cert, what in zip(certs, _CERT_ROLES, strict=True):
        if crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None:
            raise ClaimFailed(f"{what} (serial {cert.serial_number:x}) is revoked")
    return f"none of 3 certificates revoked ({len(crl)} on the list)"


def check_signature(ctx: VerifyContext) -> str:
    """The device key signed the report, and the report names the device the certificate names."""
    leaf = ctx.need_chain()[0]
    key = leaf.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ClaimFailed("device key is not an EC key")
    try:
        key.verify(ctx.evidence.signature, ctx.evidence.report, ec.ECDSA(SIG_HASH()))
    except InvalidSignature:
        raise ClaimFailed("report signature does not verify under the device key") from None
    rep = ctx.need_report()
    if rep.device_id != common_name(leaf):
        raise ClaimFailed(f"report names device {rep.device_id!r}, certificate names {common_name(leaf)!r}")
    return f"signed by device key {public_key_fingerprint(key)}"


def check_nonce(ctx: VerifyContext) -> str:
    """The report carries the verifier's fresh nonce and is neither too old nor from the future."""
    rep, policy = ctx.need_report(), ctx.policy
    if not ctx.nonce or not hmac.compare_digest(rep.nonce, ctx.nonce):
        raise ClaimFailed("report nonce is not the verifier's fresh nonce")
    age = ctx.now - rep.timestamp
    if age > policy.max_report_age_s:
        raise ClaimFailed(f"report is {age:.1f} s old (max {policy.max_report_age_s:g} s)")
    if age < -MAX_CLOCK_SKEW_S:
        raise ClaimFailed(f"report timestamp is {-age:.1f} s in the future")
    return f"fresh nonce, report {max(age, 0.0):.1f} s old"


def check_measurements(ctx: VerifyContext) -> str:
    """Firmware, driver and code each equal the policy's reference value."""
    got, want = ctx.need_report().measurements, ctx.policy.expected(code=ctx.expected_code)
    differ = [k for k in ("firmware", "driver", "code") if getattr(got, k) != getattr(want, k)]
    if differ:
        raise ClaimFailed(
            "differ from policy: "
            + ", ".join(f"{k} {getattr(got, k)[:12]}… != {getattr(want, k)[:12]}…" for k in differ)
        )
    return "firmware, driver and code match policy"


def check_mode(ctx: VerifyContext) -> str:
    """The CC mode is one the policy allows (devtools and off are not, by default)."""
    mode, allowed = ctx.need_report().cc_mode, ctx.policy.allowed_modes
    if mode not in allowed:
        raise ClaimFailed(f"cc_mode {mode.value!r} not allowed (allowed: {', '.join(m.value for m in allowed)})")
    return f"cc_mode {mode.value!r}"


@dataclass(frozen=True, slots=True)
class ClaimCheck:
    """A claim's name and the check that decides it."""

    name: str
    check: Callable[[VerifyContext], str]

    def run(self, ctx: VerifyContext) -> Claim:
        """The named claim; anything the check raises makes it false (fail closed)."""
        try:
            return Claim(self.name, True, self.check(ctx))
        except ClaimFailed as exc:
            return Claim(self.name, False, str(exc))
        except Exception as exc:  # fail closed on anything unexpected
            text = str(exc) or "no detail"
            return Claim(self.name, False, f"{type(exc).__name__}: {text}"[:200])


CHECKS: tuple[ClaimCheck, ...] = (
    ClaimCheck("chain", check_chain),
    ClaimCheck("revocation", check_revocation),
    ClaimCheck("signature", check_signature),
    ClaimCheck("nonce", check_nonce),
    ClaimCheck("measurements", check_measurements),
    ClaimCheck("mode", check_mode),
)
"""Every claim, in the order ``gputravel attest`` prints them and reports record them."""

CLAIM_NAMES = (*(c.name for c in CHECKS), "overall")


# --- the verdict -----------------------------------------------------------------------------------
def _overall(claims: list[Claim]) -> Claim:
    failed = [c.name for c in claims if not c.ok]
    return Claim("overall", not failed, f"failed: {', '.join(failed)}" if failed else "all claims hold")


def _leaf_key(ctx: VerifyContext) -> ec.EllipticCurvePublicKey | None:
    try:
        return ec_public(ctx.chain[0]) if ctx.chain else None
    except ValueError:
        return None


def _token(ctx: VerifyContext, report: Report, claims: list[Claim], secret: bytes | None) -> AttestationToken:
    return AttestationToken.issue(
        secret if secret is not None else os.urandom(32),
        device_id=report.device_id,
        measurement_digest=report.measurements.digest(),
        claims_digest=sha256_hex(canonical_json([[c.name, c.ok, c.detail] for c in claims])),
        evidence_digest=ctx.evidence.digest().hex(),
        issued_at=ctx.now,
        ttl_s=ctx.policy.token_ttl_s,
    )


def verify_evidence(
    evidence: Evidence,
    *,
    nonce: bytes,
    root: x509.Certificate,
    crl: x509.CertificateRevocationList | None,
    policy: Policy,
    now: float | None = None,
    verifier_secret: bytes | None = None,
    expected_code: str | None = None,
) -> AttestationResult:
    """Check evidence against the pinned root, the CRL, the fresh ``nonce`` and the policy.

    Never raises for bad evidence: each failure is a false claim with its reason. ``verifier_secret``
    MACs the token (a random one is used when absent); ``expected_code`` resolves a policy ``code`` of
    ``"auto"`` (default: ``code_measurement()``).
    """
    ctx = verify_context(evidence, nonce=nonce, root=root, crl=crl, policy=policy, now=now,
                         expected_code=expected_code)
    claims = [check.run(ctx) for check in CHECKS]
    claims.append(_overall(claims))
    ok, report, leaf_key = claims[-1].ok, ctx.report, _leaf_key(ctx)
    return AttestationResult(
        claims=tuple(claims),
        ok=ok,
        token=_token(ctx, report, claims, verifier_secret) if ok and report is not None else None,
        device_public_key=leaf_key if ok else None,
        device_id=report.device_id if report is not None else None,
        measurements=report.measurements if report is not None else None,
        cc_mode=report.cc_mode if report is not None else None,
        platform=report.platform if report is not None else PLATFORM_EMULATED,
        device_key_fingerprint=public_key_fingerprint(leaf_key) if leaf_key is not None else None,
    )
