"""One GPU's evidence end to end: report and chain (:mod:`.nvidia_spdm`), RIMs (:mod:`.nvidia_rim`), the policy.

``x-nvidia-overall-att-result`` is true only when no claim failed and every unchecked claim is one the policy
accepts (OCSP offline; measurements only where ``require_rims`` is false).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509

from .claims import NOT_CHECKED, Claim, ClaimSet
from .nvidia_rim import Rim, rim_certificates, rim_kind, rim_version, verify_rim
from .nvidia_spdm import load_pem_chain
from .ocsp import Post, check_chain_ocsp, http_post
from .policy import GpuPolicy
from .spdm_claims import compare_measurements, verify_report

__all__ = ["GpuVerdict", "verify_gpu"]

OVERALL = "x-nvidia-overall-att-result"
CLAIMS_VERSION = "3.0"  # NVIDIA's claims version whose names and values these are (x-nvidia-ver)


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    ok: bool
    claims: ClaimSet
    failed: Claim | None  # the first claim that failed, or an unchecked one the policy refuses

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "platform": "nvidia-gpu",
            "claims_version": CLAIMS_VERSION,
            "claims": self.claims.values(),
            "checks": self.claims.to_dict(),
            "failed_claim": self.failed.name if self.failed else None,
            "failed_reason": self.failed.detail if self.failed else None,
        }


def _pick(rims: list[Rim], kind: str, version: str) -> Rim | None:
    of_kind = [r for r in rims if r.kind == kind]
    return next((r for r in of_kind if r.version.lower() == version.lower()), of_kind[0] if of_kind else None)


def _ocsp(claims: ClaimSet, chain: list[x509.Certificate], url: str, post: Post, at: dt.datetime, *,
          name: str = "x-nvidia-gpu-attestation-report-cert-chain") -> None:
    """Fill the chain claim ``name`` with the OCSP service's answer about ``chain`` (leaf first)."""
    if name not in claims:
        return
    claim = claims[name]
    if claim.ok is False:
        return  # the chain itself failed: nothing to ask about
    result = check_chain_ocsp(chain, url, post=post, at=at)
    value = dict(claim.value)
    value["x-nvidia-cert-ocsp-status"] = result.status if result.status != "error" else "unknown"
    value["x-nvidia-cert-revocation-reason"] = result.reason
    if result.status == "revoked":
        value["x-nvidia-cert-status"] = "revoked"
    good = result.status == "good"
    claims.update(name, value, good, result.detail if not good else f"{claim.detail.split(';')[0]}; {result.detail}")


def verify_gpu(report: bytes, cert_chain: bytes, nonce: bytes, *, rims: Sequence[bytes] = (),
               policy: GpuPolicy | None = None, at: dt.datetime | None = None,
               device_root: x509.Certificate | None = None, rim_root: x509.Certificate | None = None,
               ocsp_url: str | None = None, ocsp_post: Post | None = None) -> GpuVerdict:
    """Verify a GPU's GET_MEASUREMENTS evidence under ``nonce``, against the given RIM files; never raises.

    ``ocsp_url``: ask that OCSP service about the device chain (:mod:`.ocsp`); its answer fills the chain claim's
    ``x-nvidia-cert-ocsp-status`` (``good`` passes; ``revoked``, ``unknown`` or no usable answer fail it).
    """
    policy = policy or GpuPolicy()
    at = at or dt.datetime.now(dt.UTC)
    if device_root is None and policy.device_root is not None:
        device_root = x509.load_pem_x509_certificate(policy.device_root.read_bytes())
    if rim_root is None and policy.rim_root is not None:
        rim_root = x509.load_pem_x509_certificate(policy.rim_root.read_bytes())
    claims, parsed = verify_report(report, cert_chain, nonce, root=device_root, at=at,
                                   expected_arch=policy.expected_arch)
    if ocsp_url is not None and parsed is not None:
        _ocsp(claims, load_pem_chain(cert_chain), ocsp_url, ocsp_post or http_post, at)
    checked: list[Rim] = []
    if parsed is not None:
        # each RIM is checked under its own kind's claim names; a second RIM of one kind replaces the first's
        # claims only if it matches the report's version
        for data in rims:
            kind = rim_kind(rim_version(data))
            want = parsed.driver_version if kind == "driver" else parsed.vbios_version
            scratch = ClaimSet()
            _, rim = verify_rim(data, expected_version=want, kind=kind, root=rim_root, at=at, claims=scratch)
            if ocsp_url is not None:  # the RIM's own chain, as NVIDIA's verifier asks too
                _ocsp(scratch, rim_certificates(data), ocsp_url, ocsp_post or http_post, at,
                      name=f"x-nvidia-gpu-{kind}-rim-cert-chain")
                if rim is not None and scratch[f"x-nvidia-gpu-{kind}-rim-cert-chain"].ok is False:
                    rim = None  # a revoked RIM signer vouches for nothing
            if rim is not None:
                checked.append(rim)
            matches = rim is not None and rim.version.lower() == want.lower()
            for c in scratch:
                if c.name not in claims or matches:
                    claims.add(c.name, c.value, c.ok, c.detail)
        driver = _pick(checked, "driver", parsed.driver_version)
        vbios = _pick(checked, "vbios", parsed.vbios_version)
        if driver and vbios:
            clash = sorted(set(driver.golden) & set(vbios.golden))
            claims.add("x-nvidia-gpu-vbios-index-no-conflict", not clash, not clash,
                       f"indices in both RIMs: {clash}" if clash else "")
            bad = compare_measurements(parsed, {**driver.golden, **vbios.golden}) if not clash else []
            ok = not clash and not bad
            claims.add("measres", "success" if ok else "fail", ok,
                       f"{len(driver.golden) + len(vbios.golden)} golden measurements match" if ok else
                       f"runtime measurements differ from the RIMs at indices {bad}" if bad else "index conflict")
            if ok:  # as NVIDIA's verifier (claims 3.0): secboot and dbgstat only when measres is success
                claims.add("secboot", True, True)
                claims.add("dbgstat", "disabled", True)
        else:
            missing = " and ".join(k for k, r in (("driver", driver), ("VBIOS", vbios)) if r is None)
            why = (f"no valid {missing} RIM given (report: driver {parsed.driver_version}, "
                   f"VBIOS {parsed.vbios_version})")
            claims.add("measres", NOT_CHECKED, None, why)
        claims.add("oemid", driver.manufacturer_id if driver else None, None,
                   "the driver RIM's FirmwareManufacturerId" if driver else "no valid driver RIM given")
    failed = next((c for c in claims if c.ok is False), None)
    if failed is None:
        for c in claims.unchecked():
            if c.name.endswith("-cert-chain"):
                key, waived = "accept_ocsp_not_checked = true", policy.accept_ocsp_not_checked
                remedy = "ask NVIDIA's OCSP service with --ocsp-url https://ocsp.ndis.nvidia.com"
            elif c.name == "measres":
                key, waived = "require_rims = false", not policy.require_rims
                remedy = ("give the driver and VBIOS RIMs for the report's versions with --rim, or fetch them with "
                          "--rim-url https://rim.attestation.nvidia.com")
            elif c.name in {"hwmodel", "ueid", "oemid"}:  # information, nothing to check
                continue
            else:
                failed = Claim(c.name, c.value, False, f"{c.detail} (not checked; the policy requires it)")
                break
            if waived:
                claims.update(c.name, c.value, None, f"{c.detail}; accepted unchecked: the policy's {key}")
                continue
            failed = Claim(c.name, c.value, False, f"{c.detail} (not checked; the policy requires it: {remedy}, "
                           f"or waive it with {key})")
            break
    ok = failed is None
    claims.add(OVERALL, ok, ok, "" if ok else f"first failure: {failed.name if failed else ''}")
    return GpuVerdict(ok=ok, claims=claims, failed=failed)

