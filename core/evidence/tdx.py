"""Intel TDX evidence: a version-4 quote verified with dcap-qvl against Intel's root (or a pinned other root), then
the policy (debug TDs refused, allow-lists for MRTD, RTMRs and TCB status, a minimum TEE TCB SVN, a maximum
age of the collateral).

dcap-qvl checks the quote's ECDSA signature chain (PCK certificate from the quote, PCK CRL, Intel's root CRL), the
QE report and its identity, and the TCB info for the platform's FMSPC, all against the collateral at ``now``;
collateral comes from a file (``QuoteCollateralV3`` JSON, offline) or a PCCS (online, not here). Cryptographic
failures and expired or future collateral come back as the claim ``quote-verified`` with dcap-qvl's reason.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

import dcap_qvl

from .bounded import EVIDENCE_CAP
from .claims import REPORT_DATA_NOT_GIVEN, report_data_mismatch
from .policy import TdxPolicy

__all__ = ["TDX_DEBUG_BIT", "TdxVerdict", "apply_tdx_policy", "quote_extent_problem", "tcb_info_issued",
           "verify_tdx_quote"]

TDX_DEBUG_BIT = 0  # TD_ATTRIBUTES bit 0: TUD.DEBUG
QUOTE_VERSION = 4
HEADER_LEN = 48
TD_REPORT10_LEN = 584
MAX_ZERO_PADDING = 4096


@dataclass(frozen=True, slots=True)
class TdxVerdict:
    """What a verified quote says and what the policy made of it; ``failed`` names the first failed claim."""

    ok: bool
    tcb_status: str | None = None
    advisory_ids: tuple[str, ...] = ()
    mr_td: str = ""
    rtmrs: tuple[str, ...] = ()
    report_data: str = ""
    td_attributes: str = ""
    tee_tcb_svn: str = ""
    #: the TCB info's issueDate (ISO 8601, as Intel signed it): what max_collateral_age_days counts from
    collateral_issued: str = ""
    #: when the collateral becomes older than the policy's max_collateral_age_days (Unix s; None: no limit): a
    #: verdict kept for reuse must not outlive it
    age_limit: float | None = None
    failed: str | None = None
    reason: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    # claims the policy did not ask for (an empty allow-list): name -> why; never in ``checks``
    not_checked: dict[str, str] = field(default_factory=dict)

    @property
    def debug(self) -> bool:
        if not self.td_attributes:
            return False
        return bool(bytes.fromhex(self.td_attributes)[0] >> TDX_DEBUG_BIT & 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "platform": "intel-tdx",
            "tcb_status": self.tcb_status,
            "advisory_ids": list(self.advisory_ids),
            "mr_td": self.mr_td,
            "rtmrs": list(self.rtmrs),
            "report_data": self.report_data,
            "td_attributes": self.td_attributes,
            "tee_tcb_svn": self.tee_tcb_svn,
            "debug": self.debug if self.td_attributes else None,  # None: no verified TD report to read it from
            "checks": self.checks,
            "not_checked": self.not_checked,
            "failed_claim": self.failed,
            "failed_reason": self.reason or None,
        }


def _refused(claim: str, reason: str, checks: dict[str, bool]) -> TdxVerdict:
    return TdxVerdict(ok=False, failed=claim, reason=reason, checks={**checks, claim: False})


def verify_tdx_quote(quote: bytes, collateral_json: str | bytes, *, now: int | None = None,
                     root_ca_der: bytes | None = None, policy: TdxPolicy | None = None,
                     expected_report_data: bytes | None = None) -> TdxVerdict:
    """Verify a TDX v4 quote with its collateral at ``now`` (Unix seconds, default: now); never raises.

    ``root_ca_der`` pins another root than Intel's (dcap-qvl's ``verify_with_root_ca``): the SIM platform's.
    ``expected_report_data`` (1 to 64 bytes, zero-padded): the report data the verifier asked for (its nonce),
    claim ``report-data-match``; None leaves it in ``not_checked``.
    """
    checks: dict[str, bool] = {}
    why = quote_extent_problem(quote)
    if why:
        return _refused("quote-parsed", why, checks)
    if len(collateral_json) > EVIDENCE_CAP:
        return _refused("collateral-parsed", f"the collateral is {len(collateral_json):,} bytes, over the "
                        f"{EVIDENCE_CAP:,}-byte cap", checks)
    try:
        parsed = dcap_qvl.parse_quote(quote)
        version = parsed.header.version
    except (ValueError, TypeError) as exc:
        return _refused("quote-parsed", f"not a quote: {exc}", checks)
    if not parsed.is_tdx() or version != QUOTE_VERSION:
        return _refused("quote-parsed", f"not a TDX version-4 quote (version {version}, "
                        f"{'TDX' if parsed.is_tdx() else 'SGX'})", checks)
    checks["quote-parsed"] = True
    try:
        text = collateral_json.decode("utf-8") if isinstance(collateral_json, bytes) else collateral_json
        collateral = dcap_qvl.QuoteCollateralV3.from_json(text)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        return _refused("collateral-parsed", f"collateral is not QuoteCollateralV3 JSON: {exc}", checks)
    checks["collateral-parsed"] = True
    at = int(time.time()) if now is None else int(now)
    policy = policy or TdxPolicy()
    if root_ca_der is None and policy.root_ca is not None:
        try:
            root_ca_der = _der_certificate(policy.root_ca.read_bytes())
        except (OSError, ValueError) as exc:
            return _refused("root-ca", f"{policy.root_ca}: not a certificate ({exc})", checks)
    try:
        if root_ca_der is None:
            verified = dcap_qvl.verify(quote, collateral, at)
        else:
            verified = dcap_qvl.verify_with_root_ca(quote, collateral, root_ca_der, at)
        body = json.loads(verified.to_json())
    except (ValueError, TypeError, RuntimeError) as exc:
        reason = str(exc).removeprefix("Verification failed: ")
        if "debug mode" in reason.lower():  # dcap-qvl refuses debug TDs itself, after the signatures held
            return _refused("td-not-debug", f"the TD is debuggable (dcap-qvl: {reason})", {**checks,
                                                                                         "quote-verified": True})
        return _refused("quote-verified", reason, checks)
    checks["quote-verified"] = True
    report: dict[str, Any] = next(iter(body.get("report", {}).values()), {})
    verdict = TdxVerdict(
        ok=True,
        tcb_status=str(body.get("status")),
        advisory_ids=tuple(body.get("advisory_ids", [])),
        mr_td=str(report.get("mr_td", "")),
        rtmrs=tuple(str(report.get(f"rt_mr{i}", "")) for i in range(4)),
        report_data=str(report.get("report_data", "")),
        td_attributes=str(report.get("td_attributes", "")),
        tee_tcb_svn=str(report.get("tee_tcb_svn", "")).lower(),
        collateral_issued=tcb_info_issued(text),
        checks=checks,
    )
    if expected_report_data is None:
        verdict = replace(verdict, not_checked={"report-data-match": REPORT_DATA_NOT_GIVEN})
    elif why := report_data_mismatch(bytes.fromhex(verdict.report_data), expected_report_data):
        return replace(verdict, ok=False, failed="report-data-match", reason=why,
                       checks={**checks, "report-data-match": False})
    else:
        verdict = replace(verdict, checks={**checks, "report-data-match": True})
    return apply_tdx_policy(verdict, policy, at=at)


def tcb_info_issued(collateral_json: str) -> str:
    """The collateral's TCB info ``issueDate`` ('' when it cannot be read; dcap-qvl refused such collateral)."""
    try:
        return str(json.loads(json.loads(collateral_json)["tcb_info"])["issueDate"])
    except (ValueError, KeyError, TypeError):
        return ""


def _utc(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(dt.UTC)


def quote_extent_problem(quote: bytes) -> str:
    """Why the bytes are not exactly one v4 quote ('' when they are): the header (48), the TD report (584), the
    signature data's u32 length and the signature data; after it only zero padding of at most
    :data:`MAX_ZERO_PADDING` bytes (dcap-qvl's real sample carries 70 zero bytes after its quote; a TD's quote
    buffer is padded), never other bytes."""
    if len(quote) > EVIDENCE_CAP:
        return f"{len(quote):,} bytes, over the {EVIDENCE_CAP:,}-byte cap"
    body_end = HEADER_LEN + TD_REPORT10_LEN
    if len(quote) < body_end + 4:
        return f"{len(quote)} bytes is too short for a version-4 TDX quote"
    end = body_end + 4 + int.from_bytes(quote[body_end:body_end + 4], "little")
    if end > len(quote):
        return f"the signature data says {end - body_end - 4} bytes, {len(quote) - body_end - 4} present"
    tail = quote[end:]
    if len(tail) > MAX_ZERO_PADDING or any(tail):
        return (f"{len(tail):,} bytes follow the quote's signature data (only up to {MAX_ZERO_PADDING} zero bytes of "
                "padding are accepted)")
    return ""


def _der_certificate(data: bytes) -> bytes:
    """DER of a certificate given as DER or PEM."""
    if b"-----BEGIN CERTIFICATE-----" in data:
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import Encoding

        return x509.load_pem_x509_certificate(data).public_bytes(Encoding.DER)
    return data


def apply_tdx_policy(verdict: TdxVerdict, policy: TdxPolicy, *, at: float | None = None) -> TdxVerdict:
    """The verdict with the policy's checks: never debug, TCB status, the TEE TCB SVN's minimum, the collateral's
    age at ``at`` (Unix s, default now), MRTD and RTMR allow-lists. An empty allow-list or an unset key accepts any
    value: that claim goes to ``not_checked`` with why, never to ``checks``."""
    checks, skipped = dict(verdict.checks), dict(verdict.not_checked)

    def refuse(claim: str, reason: str) -> TdxVerdict:
        return replace(verdict, ok=False, failed=claim, reason=reason, checks={**checks, claim: False},
                       not_checked=skipped)

    if verdict.debug:
        return refuse("td-not-debug", "the TD is debuggable (TD_ATTRIBUTES.DEBUG set): its memory is readable")
    checks["td-not-debug"] = True
    if verdict.tcb_status not in policy.tcb_status:
        return refuse("tcb-status", f"TCB status {verdict.tcb_status} is not one of {list(policy.tcb_status)}")
    checks["tcb-status"] = True
    if not policy.min_tee_tcb_svn:
        skipped["tee-tcb-svn"] = ("the policy does not set min_tee_tcb_svn: any TEE TCB SVN (the TDX module's) "
                                  "accepted; tcb_status still applies")
    else:
        have = bytes.fromhex(verdict.tee_tcb_svn or "").ljust(16, b"\0")[:16]
        want = bytes.fromhex(policy.min_tee_tcb_svn)
        below = [f"byte {i}: {h} < {w}" for i, (h, w) in enumerate(zip(have, want, strict=True)) if h < w]
        if below:
            return refuse("tee-tcb-svn", f"the TD's TEE_TCB_SVN {have.hex()} is below the policy's min_tee_tcb_svn "
                          f"{want.hex()} ({', '.join(below)}): the host's TDX module must be updated, or lower "
                          "the minimum")
        checks["tee-tcb-svn"] = True
    verdict = _age_checked(verdict, policy, checks, skipped, time.time() if at is None else at)
    if verdict.failed:
        return verdict
    for claim, key, value, allowed in (("mr-td", "mr_td", verdict.mr_td, policy.mr_td),
                                       *((f"rtmr{i}", f"rtmr{i}", verdict.rtmrs[i], policy.rtmrs[i])
                                         for i in range(4))):
        if not allowed:
            skipped[claim] = f"the policy's {key} allow-list is empty: any value accepted"
            continue
        if value.lower() not in allowed:
            return refuse(claim, f"{claim.upper().replace('-', '')} {value[:16]}... is not in the policy's "
                          "allow-list")
        checks[claim] = True
    return replace(verdict, checks=checks, not_checked=skipped)


def _age_checked(verdict: TdxVerdict, policy: TdxPolicy, checks: dict[str, bool], skipped: dict[str, str],
                 at: float) -> TdxVerdict:
    """Claim ``collateral-age``: days from the TCB info's issueDate to ``at`` against max_collateral_age_days
    (``checks``/``skipped`` are updated in place; a refused verdict is returned with ``failed`` set)."""
    limit = policy.max_collateral_age_days
    if limit is None:
        skipped["collateral-age"] = ("the policy does not set max_collateral_age_days: collateral of any age inside "
                                     "its validity window (the TCB info's issueDate to nextUpdate) is accepted")
        return verdict
    if not verdict.collateral_issued:
        return replace(verdict, ok=False, failed="collateral-age", checks={**checks, "collateral-age": False},
                       not_checked=skipped, reason="the collateral's TCB info has no readable issueDate")
    issued = _utc(verdict.collateral_issued)
    until = issued.timestamp() + limit * 86400
    age = (at - issued.timestamp()) / 86400
    if at > until:
        when = dt.datetime.fromtimestamp(at, dt.UTC)
        return replace(verdict, ok=False, failed="collateral-age", checks={**checks, "collateral-age": False},
                       not_checked=skipped,
                       reason=f"the collateral's TCB info was issued {issued:%Y-%m-%d %H:%M} UTC, {age:.1f} days "
                              f"before {when:%Y-%m-%d %H:%M} UTC; the policy's max_collateral_age_days is {limit}: "
                              "fetch fresh collateral (--pccs-url, or a newer `gputravel evidence bundle`) or raise the limit")
    checks["collateral-age"] = True
    return replace(verdict, age_limit=until)
