"""AMD SEV-SNP evidence: a report (:mod:`.snp_report`) and its VCEK (or VLEK), checked to AMD's pinned ARK.

The chain: ARK (AMD's root for the product, pinned) signs ASK (pinned too; for a VLEK, the ASVK, given by the
policy) signs the VCEK, each with RSASSA-PSS SHA-384, salt 48; every certificate valid at ``now``. The report's
signature is ECDSA P-384 with SHA-384 over bytes 0..0x29F, r and s little-endian, by the VCEK's key. The VCEK
carries AMD's extensions (1.3.6.1.4.1.3704.1.*): the TCB it was derived for (boot loader, TEE, SNP, microcode
SPLs; FMC on Turin), which must equal the report's REPORTED_TCB, and the chip id (hwID; 8 bytes on Turin), which
must equal the report's CHIP_ID. Then the policy (``[amd-snp]``): a guest whose policy allows debugging is always
refused (claim ``guest-not-debug``; no key lets it through), SMT and a migration agent where the policy refuses
them (``allow_smt``, ``allow_migration_agent``), the VMPL, a minimum TCB, and allow-lists for the
measurement, host_data and the ID key digest. Revocation: AMD's CRL where the policy names one (``crl``, signed
by the ARK; ``require_crl`` refuses a report without). Only the standard library and ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import functools
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from .bounded import EvidenceTooLarge, read_hex_or_raw
from .claims import REPORT_DATA_NOT_GIVEN, report_data_mismatch
from .policy import SnpPolicy
from .snp_report import (
    POLICY_MIGRATE_MA_BIT,
    POLICY_SMT_BIT,
    PRODUCTS,
    SnpFormatError,
    SnpReport,
    Tcb,
    parse_snp_report,
    product_of_cpuid,
)

__all__ = ["SnpVerdict", "amd_roots", "load_certificate", "verify_snp_report"]

AMD_CERTS = Path(__file__).resolve().parent / "certs" / "amd"
OID_AMD = "1.3.6.1.4.1.3704.1."
OID_PRODUCT_NAME = OID_AMD + "2"
OID_HWID = OID_AMD + "4"
OID_SPL = {"boot_loader": OID_AMD + "3.1", "tee": OID_AMD + "3.2", "snp": OID_AMD + "3.3",
           "microcode": OID_AMD + "3.8", "fmc": OID_AMD + "3.9"}
PSS_SHA384 = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
PLATFORM = "amd-sev-snp"


@dataclass(frozen=True, slots=True)
class SnpVerdict:
    """What the report says and what the checks made of it; ``failed`` names the first failed claim."""

    ok: bool
    platform: str = PLATFORM
    report: SnpReport | None = None
    product: str | None = None
    failed: str | None = None
    reason: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    # claims the policy did not ask for (an empty allow-list, min_tcb {}): name -> why; never in ``checks``
    not_checked: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``attest --snp-report --json`` document (exactly these keys)."""
        r = self.report
        return {
            "ok": self.ok,
            "platform": self.platform,
            "measurement": r.measurement.hex() if r else None,
            "report_data": r.report_data.hex() if r else None,
            "reported_tcb": Tcb.from_raw(r.reported_tcb, self.product or "milan").to_json() if r else None,
            "chip_id": r.chip_id.hex() if r else None,
            "policy": r.policy_json() if r else None,
            "checks": self.checks,
            "not_checked": self.not_checked,
            "failed_claim": self.failed,
        }


def load_certificate(data: bytes) -> x509.Certificate:
    """A certificate given as DER or PEM (AMD's VCEKs have serial 0, which cryptography warns about: silenced).

    Raises:
        ValueError: not a certificate.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if b"-----BEGIN CERTIFICATE-----" in data:
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)


@functools.cache
def amd_roots(product: str) -> tuple[x509.Certificate, x509.Certificate]:
    """AMD's ARK and ASK for ``product`` (milan, genoa, turin), as shipped in ``certs/amd/``."""
    if product not in PRODUCTS:
        raise ValueError(f"unknown SEV-SNP product {product!r} (one of {', '.join(PRODUCTS)})")
    return (load_certificate((AMD_CERTS / f"{product}-ark.crt").read_bytes()),
            load_certificate((AMD_CERTS / f"{product}-ask.crt").read_bytes()))


def _cn(name: x509.Name) -> str:
    attrs = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _pss_issued(child: x509.Certificate, issuer: x509.Certificate, at: dt.datetime) -> str | None:
    """None when ``issuer`` signed ``child`` (RSASSA-PSS SHA-384, salt 48) and ``child`` is valid at ``at``."""
    if child.issuer != issuer.subject:
        return f"{_cn(child.subject)!r} is issued by {_cn(child.issuer)!r}, not by {_cn(issuer.subject)!r}"
    key = issuer.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        return f"{_cn(issuer.subject)!r} has no RSA key"
    try:
        key.verify(child.signature, child.tbs_certificate_bytes, PSS_SHA384, hashes.SHA384())
    except InvalidSignature:
        return f"the signature on {_cn(child.subject)!r} does not verify with {_cn(issuer.subject)!r} (RSASSA-PSS SHA-384)"
    if not child.not_valid_before_utc <= at <= child.not_valid_after_utc:
        return (f"{_cn(child.subject)!r} is valid {child.not_valid_before_utc:%Y-%m-%d} to "
                f"{child.not_valid_after_utc:%Y-%m-%d}, not at {at:%Y-%m-%d %H:%M}")
    return None


def _der_int(value: bytes) -> int | None:
    if len(value) < 3 or value[0] != 0x02 or value[1] != len(value) - 2:
        return None
    return int.from_bytes(value[2:], "big")


def _ext(cert: x509.Certificate, oid: str) -> bytes | None:
    try:
        value = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value
    except x509.ExtensionNotFound:
        return None
    return value.value if isinstance(value, x509.UnrecognizedExtension) else None


def vcek_tcb(cert: x509.Certificate, product: str) -> Tcb | None:
    """The TCB a VCEK (or VLEK) was issued for, from its extensions (None when one is missing)."""
    spl: dict[str, int] = {}
    for name, oid in OID_SPL.items():
        if name == "fmc" and product != "turin":
            continue
        raw = _ext(cert, oid)
        value = _der_int(raw) if raw is not None else None
        if value is None:
            return None
        spl[name] = value
    return Tcb(boot_loader=spl["boot_loader"], tee=spl["tee"], snp=spl["snp"], microcode=spl["microcode"],
               fmc=spl.get("fmc"))


def vcek_hwid(cert: x509.Certificate) -> bytes | None:
    """The chip id a VCEK names (raw, or an OCTET STRING's content)."""
    raw = _ext(cert, OID_HWID)
    if raw is not None and len(raw) > 2 and raw[0] == 0x04 and raw[1] == len(raw) - 2:
        return raw[2:]
    return raw


def _product_of(cert: x509.Certificate) -> str | None:
    name = _cn(cert.issuer).lower()
    return next((p for p in PRODUCTS if p in name), None)


def _refused(claim: str, reason: str, checks: dict[str, bool], **kw: Any) -> SnpVerdict:
    return SnpVerdict(ok=False, failed=claim, reason=reason, checks={**checks, claim: False}, **kw)


def verify_snp_report(report: bytes, vcek: bytes, *, product: str | None = None, now: int | None = None,
                      policy: SnpPolicy | None = None, expected_report_data: bytes | None = None) -> SnpVerdict:
    """Verify an SEV-SNP report (raw or hex) with its VCEK/VLEK (DER or PEM) at ``now``; never raises.

    ``expected_report_data`` (1 to 64 bytes, zero-padded): the report data the verifier asked for (its nonce),
    claim ``report-data-match``; None leaves it in ``not_checked``."""
    policy = policy or SnpPolicy()
    checks: dict[str, bool] = {}
    try:
        parsed = parse_snp_report(read_hex_or_raw(report))
    except (SnpFormatError, EvidenceTooLarge) as exc:
        return _refused("report-parsed", str(exc), checks)
    checks["report-parsed"] = True
    try:
        cert = load_certificate(read_hex_or_raw(vcek))
    except (ValueError, EvidenceTooLarge) as exc:
        return _refused("cert-chain-validated", f"the VCEK is not a certificate ({exc})", checks, report=parsed)
    named = _product_of(cert)
    chosen = product or named
    cpuid_product = product_of_cpuid(parsed.cpuid[0], parsed.cpuid[1])
    kw: dict[str, Any] = {"report": parsed, "product": chosen}
    if chosen not in PRODUCTS:
        return _refused("product", f"no product given and the VCEK's issuer {_cn(cert.issuer)!r} names none of "
                        f"{', '.join(PRODUCTS)}", checks, **kw)
    if named is not None and named != chosen:
        return _refused("product", f"--product {chosen}, but the VCEK is issued by {_cn(cert.issuer)!r}", checks, **kw)
    if cpuid_product is not None and cpuid_product != chosen:
        return _refused("product", f"the report's CPUID (family {parsed.cpuid[0]:#x}, model {parsed.cpuid[1]:#x}) "
                        f"is a {cpuid_product} part, not {chosen}", checks, **kw)
    checks["product"] = True
    at = dt.datetime.fromtimestamp(int(time.time()) if now is None else now, dt.UTC)
    why = _chain(cert, chosen, parsed, policy, at)
    if why:
        return _refused("cert-chain-validated", why, checks, **kw)
    checks["cert-chain-validated"] = True
    kind = "vlek" if _cn(cert.subject) == "SEV-VLEK" or "VLEK" in _cn(cert.issuer) else "vcek"
    if parsed.signing_key != kind:
        return _refused("signing-key", f"the report says it is signed by the {parsed.signing_key.upper()}, the "
                        f"certificate is a {kind.upper()}", checks, **kw)
    checks["signing-key"] = True
    key = cert.public_key()
    try:
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
            raise InvalidSignature
        key.verify(encode_dss_signature(parsed.r, parsed.s), parsed.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return _refused("report-signature-verified", "the report's ECDSA P-384 signature does not verify with the "
                        f"{kind.upper()}'s key{_other_chip(cert, parsed, chosen, kind)}", checks, **kw)
    checks["report-signature-verified"] = True
    reported, issued = Tcb.from_raw(parsed.reported_tcb, chosen), vcek_tcb(cert, chosen)
    if issued != reported:
        return _refused("tcb-match", f"the {kind.upper()} was issued for TCB {issued.to_json() if issued else 'none'}, "
                        f"the report's reported TCB is {reported.to_json()}", checks, **kw)
    checks["tcb-match"] = True
    if kind == "vcek" and not parsed.mask_chip_key and any(parsed.chip_id):
        hwid = vcek_hwid(cert) or b""
        size = 8 if chosen == "turin" else 64
        if len(hwid) != size or parsed.chip_id[:size] != hwid or any(parsed.chip_id[size:]):
            return _refused("chip-id-match", f"the VCEK's hwID {hwid.hex()[:16]}... is not the report's chip id "
                            f"{parsed.chip_id.hex()[:16]}...", checks, **kw)
    checks["chip-id-match"] = True
    skipped: dict[str, str] = {}
    revoked = _revocation(cert, kind, chosen, parsed, policy, at)
    if revoked is None:
        checks["cert-chain-not-revoked"] = True
    elif revoked[0]:
        return _refused("cert-chain-not-revoked", revoked[1], checks, **kw)
    else:
        skipped["cert-chain-not-revoked"] = revoked[1]
    if expected_report_data is None:
        skipped["report-data-match"] = REPORT_DATA_NOT_GIVEN
    elif why := report_data_mismatch(parsed.report_data, expected_report_data):
        return _refused("report-data-match", why, checks, **kw)
    else:
        checks["report-data-match"] = True
    return apply_snp_policy(SnpVerdict(ok=True, checks=checks, not_checked=skipped, **kw), policy)


def _other_chip(cert: x509.Certificate, report: SnpReport, product: str, kind: str) -> str:
    """When the VCEK names another chip than the report: that, and where this chip's VCEK comes from ('' else)."""
    hwid = vcek_hwid(cert) or b""
    size = 8 if product == "turin" else 64
    if kind != "vcek" or report.mask_chip_key or not any(report.chip_id) or report.chip_id[:size] == hwid:
        return ""
    return (f": it is another chip's VCEK (its hwID {hwid.hex()[:16]}..., the report's chip id "
            f"{report.chip_id.hex()[:16]}...); give this chip's, from AMD's KDS by chip id and reported TCB "
            "(--kds-url https://kdsintf.amd.com) or the host's extended report")


def _pinned(product: str, report: SnpReport, policy: SnpPolicy) -> tuple[x509.Certificate, x509.Certificate] | str:
    """The ARK and the ASK (or ASVK) the policy pins for ``product``, or why they cannot be had."""
    ark, ask = amd_roots(product)
    try:
        if policy.ark is not None:
            ark = load_certificate(policy.ark.read_bytes())
        if report.signing_key == "vlek":
            if policy.asvk is None:
                return "a VLEK needs AMD's ASVK for the product (policy key asvk; none is pinned here)"
            ask = load_certificate(policy.asvk.read_bytes())
        elif policy.ask is not None:
            ask = load_certificate(policy.ask.read_bytes())
    except (OSError, ValueError) as exc:
        return f"a pinned certificate of the policy cannot be read ({exc})"
    return ark, ask


def _revocation(cert: x509.Certificate, kind: str, product: str, report: SnpReport, policy: SnpPolicy,
                at: dt.datetime) -> tuple[bool, str] | None:
    """Claim ``cert-chain-not-revoked``: None when the policy's CRL was checked and names neither the ASK nor the
    VCEK; ``(True, why)`` refused; ``(False, why)`` not checked (no CRL, and ``require_crl`` is false)."""
    where = f"KDS https://kdsintf.amd.com/vcek/v1/{product.capitalize()}/crl"
    if policy.crl is None:
        if policy.require_crl:
            return True, (f"the policy's require_crl = true and it names no CRL: fetch AMD's ({where}) and name the "
                          "file in [amd-snp] crl")
        return False, (f"AMD's CRL for the ASK and VCEK ({where}) is not checked: a revoked VCEK or ASK passes "
                       "(waived: the policy's require_crl = false; name the CRL file in [amd-snp] crl to check it)")
    pinned = _pinned(product, report, policy)
    if isinstance(pinned, str):
        return True, pinned
    try:
        data = policy.crl.read_bytes()
        crl = (x509.load_pem_x509_crl(data) if b"-----BEGIN X509 CRL-----" in data else x509.load_der_x509_crl(data))
    except (OSError, ValueError) as exc:
        return True, f"{policy.crl}: not a CRL, DER or PEM ({exc}); fetch AMD's from {where}"
    why = crl_problem(crl, pinned[0], ((pinned[1], "ASK" if kind == "vcek" else "ASVK"), (cert, kind.upper())), at)
    return (True, f"{why} ({policy.crl}; AMD's is at {where})") if why else None


def crl_problem(crl: x509.CertificateRevocationList, ark: x509.Certificate,
                certs: tuple[tuple[x509.Certificate, str], ...], at: dt.datetime) -> str:
    """Why ``crl`` does not clear ``certs`` ('' when it does): the ARK issued and signed it (RSASSA-PSS SHA-384,
    salt 48, as AMD signs), it is current at ``at``, and no serial of ``certs`` is in it."""
    if crl.issuer != ark.subject:
        return f"the CRL is issued by {_cn(crl.issuer)!r}, not by the pinned ARK {_cn(ark.subject)!r}"
    key = ark.public_key()
    try:
        if not isinstance(key, rsa.RSAPublicKey):
            raise InvalidSignature
        key.verify(crl.signature, crl.tbs_certlist_bytes, PSS_SHA384, hashes.SHA384())
    except InvalidSignature:
        return f"the CRL's signature does not verify with the pinned ARK {_cn(ark.subject)!r} (RSASSA-PSS SHA-384)"
    end = crl.next_update_utc
    if at < crl.last_update_utc or (end is not None and at > end):
        return (f"the CRL is valid {crl.last_update_utc:%Y-%m-%d} to {f'{end:%Y-%m-%d}' if end else 'no end'}, not "
                f"at {at:%Y-%m-%d %H:%M}: fetch a current one")
    for cert, what in certs:
        revoked = crl.get_revoked_certificate_by_serial_number(cert.serial_number)
        if revoked is not None:
            return (f"the {what} {_cn(cert.subject)!r} (serial {cert.serial_number:#x}) is revoked since "
                    f"{revoked.revocation_date_utc:%Y-%m-%d}")
    return ""


def _chain(cert: x509.Certificate, product: str, report: SnpReport, policy: SnpPolicy, at: dt.datetime) -> str:
    """The reason the chain fails ('' when ARK -> ASK (or ASVK) -> VCEK/VLEK holds at ``at``)."""
    pinned = _pinned(product, report, policy)
    if isinstance(pinned, str):
        return pinned
    ark, ask = pinned
    for child, issuer in ((ark, ark), (ask, ark), (cert, ask)):
        why = _pss_issued(child, issuer, at)
        if why:
            return why
    return ""


def apply_snp_policy(verdict: SnpVerdict, policy: SnpPolicy) -> SnpVerdict:
    """The verdict with the policy's checks: never debug, SMT and migration agent (where refused), VMPL, minimum
    TCB, allow-lists. An empty allow-list, ``min_tcb = {}`` or an unset ``allow_*`` key accepts any value: that claim goes to ``not_checked`` with why, never to ``checks``."""
    assert verdict.report is not None and verdict.product is not None
    r, checks, skipped = verdict.report, dict(verdict.checks), dict(verdict.not_checked)

    def refuse(claim: str, reason: str) -> SnpVerdict:
        return SnpVerdict(ok=False, report=r, product=verdict.product, platform=verdict.platform, failed=claim,
                          reason=reason, checks={**checks, claim: False}, not_checked=skipped)

    if r.debug:
        return refuse("guest-not-debug", "the guest policy allows debugging (bit 19): the host can read its memory")
    checks["guest-not-debug"] = True
    for claim, key, allow, bit, what, fix in (
            ("guest-no-smt", "allow_smt", policy.allow_smt, POLICY_SMT_BIT, "SMT",
             "launch the guest with SMT disallowed (the host then runs it with SMT off)"),
            ("guest-no-migration-agent", "allow_migration_agent", policy.allow_migration_agent, POLICY_MIGRATE_MA_BIT,
             "a migration agent", "launch the guest without a migration agent")):
        if allow is None:
            skipped[claim] = (f"the policy does not set {key}: a guest that allows {what} (guest policy bit {bit}) "
                              f"is accepted; {key} = false refuses one")
        elif allow:
            skipped[claim] = f"the policy's {key} = true: a guest that allows {what} (bit {bit}) is accepted"
        elif r.policy >> bit & 1:
            return refuse(claim, f"the guest policy allows {what} (bit {bit} of {r.policy:#x}) and the policy's "
                          f"{key} = false refuses that: {fix}, or set {key} = true")
        else:
            checks[claim] = True
    if r.vmpl not in policy.vmpl:
        return refuse("vmpl", f"the report was requested at VMPL {r.vmpl}, the policy allows {list(policy.vmpl)}")
    checks["vmpl"] = True
    if policy.min_tcb:
        below = Tcb.from_raw(r.reported_tcb, verdict.product).below(dict(policy.min_tcb))
        if below:
            return refuse("min-tcb", f"the reported TCB is below the policy's minimum: {', '.join(below)} (the "
                          "host must update its firmware; a VCEK for the new TCB comes with it)")
        checks["min-tcb"] = True
    else:
        skipped["min-tcb"] = "the policy's min_tcb is {}: any TCB accepted"
    for claim, key, value, allowed in (("measurement", "measurement", r.measurement, policy.measurement),
                                       ("host-data", "host_data", r.host_data, policy.host_data),
                                       ("id-key-digest", "id_key_digest", r.id_key_digest, policy.id_key_digest)):
        if not allowed:
            skipped[claim] = f"the policy's {key} allow-list is empty: any value accepted"
            continue
        if value.hex() not in allowed:
            return refuse(claim, f"{claim} {value.hex()[:16]}... is not in the policy's allow-list")
        checks[claim] = True
    return SnpVerdict(ok=True, report=r, product=verdict.product, platform=verdict.platform, checks=checks,
                      not_checked=skipped)
