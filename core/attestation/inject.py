"""The emulated attestation run, and the faults ``gputravel attest --inject`` makes it suffer.

Each fault makes the device or the vendor misbehave in memory only (the persisted PKI under the
state dir is never changed) and is aimed at exactly one claim: see ``TARGET``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography import x509

from gputravel.core.attestation.evidence import (
    CCMode,
    Evidence,
    Measurements,
    emulated_measurements,
    make_evidence,
    sha256_hex,
)
from gputravel.core.attestation.pki import DeviceIdentity, VendorCA, provision_emulated
from gputravel.core.attestation.policy import Policy, load_policy
from gputravel.core.attestation.result import AttestationResult
from gputravel.core.attestation.verify import VerifyContext, verify_context, verify_evidence
from gputravel.core.errors import ConfigError

__all__ = [
    "INJECTIONS",
    "TARGET",
    "Injection",
    "StagedAttestation",
    "run_emulated_attestation",
    "stage_emulated_attestation",
]


class Injection(StrEnum):
    """Faults ``run_emulated_attestation`` can inject (in memory only; the saved PKI is untouched)."""

    REVOKED_CERT = "revoked-cert"
    BAD_CHAIN = "bad-chain"
    STALE_NONCE = "stale-nonce"
    MEASUREMENT_MISMATCH = "measurement-mismatch"
    DEVTOOLS = "devtools"


INJECTIONS: tuple[str, ...] = tuple(i.value for i in Injection)

TARGET: dict[Injection, str] = {
    Injection.REVOKED_CERT: "revocation",
    Injection.BAD_CHAIN: "chain",
    Injection.STALE_NONCE: "nonce",
    Injection.MEASUREMENT_MISMATCH: "measurements",
    Injection.DEVTOOLS: "mode",
}
"""The one claim each fault is meant to fail (with ``overall``)."""


@dataclass(frozen=True, slots=True)
class _Device:
    """What the device signs, before a fault bends it."""

    ca: VendorCA
    identity: DeviceIdentity
    measurements: Measurements
    nonce: bytes
    timestamp: float
    cc_mode: CCMode


def _revoke_leaf(dev: _Device, policy: Policy) -> _Device:
    dev.ca.revoke(dev.identity.leaf.serial_number)  # this in-memory copy is never saved
    return dev


def _rogue_root(dev: _Device, policy: Policy) -> _Device:
    # A fake device certificate: same vendor name and device id, but a rogue root.
    return dataclasses.replace(dev, identity=VendorCA.generate(dev.ca.name).issue_device(dev.identity.device_id))


def _replay_old_nonce(dev: _Device, policy: Policy) -> _Device:
    # An earlier session's nonce, replayed, in a report older than the policy allows.
    return dataclasses.replace(dev, nonce=os.urandom(32), timestamp=dev.timestamp - policy.max_report_age_s - 300)


def _tamper_firmware(dev: _Device, policy: Policy) -> _Device:
    tampered = dataclasses.replace(dev.measurements, firmware=sha256_hex(b"gputravel tampered firmware"))
    return dataclasses.replace(dev, measurements=tampered)


def _devtools_mode(dev: _Device, policy: Policy) -> _Device:
    return dataclasses.replace(dev, cc_mode=CCMode.DEVTOOLS)


_FAULTS: dict[Injection, Callable[[_Device, Policy], _Device]] = {
    Injection.REVOKED_CERT: _revoke_leaf,
    Injection.BAD_CHAIN: _rogue_root,
    Injection.STALE_NONCE: _replay_old_nonce,
    Injection.MEASUREMENT_MISMATCH: _tamper_firmware,
    Injection.DEVTOOLS: _devtools_mode,
}


@dataclass(frozen=True, slots=True)
class StagedAttestation:
    """The evidence the device produced and everything the verifier checks it against."""

    evidence: Evidence
    nonce: bytes
    root: x509.Certificate
    crl: x509.CertificateRevocationList
    policy: Policy
    expected_code: str

    def context(self, *, now: float | None = None) -> VerifyContext:
        """What the checks read, for running them one at a time."""
        return verify_context(self.evidence, nonce=self.nonce, root=self.root, crl=self.crl, policy=self.policy,
                              now=now, expected_code=self.expected_code)

    def verify(self, *, verifier_secret: bytes | None = None) -> AttestationResult:
        return verify_evidence(self.evidence, nonce=self.nonce, root=self.root, crl=self.crl, policy=self.policy,
                               verifier_secret=verifier_secret, expected_code=self.expected_code)


def _injection(inject: str | None) -> Injection | None:
    if inject is None:
        return None
    try:
        return Injection(inject)
    except ValueError:
        raise ConfigError(f"unknown injection {inject!r} (choose from {', '.join(INJECTIONS)})") from None


def stage_emulated_attestation(
    state_dir: Path, *, inject: str | None = None, policy: Policy | None = None
) -> StagedAttestation:
    """Provision (or load) the emulated vendor and device and have the device answer a fresh nonce.

    ``inject`` (one of ``INJECTIONS``) bends the device or the vendor first, in memory only.
    """
    fault = _injection(inject)
    policy = load_policy() if policy is None else policy
    ca, identity = provision_emulated(state_dir)
    measurements = emulated_measurements()
    nonce = os.urandom(32)
    dev = _Device(ca, identity, measurements, nonce, time.time(), CCMode.ON)
    if fault is not None:
        dev = _FAULTS[fault](dev, policy)
    evidence = make_evidence(dev.identity, nonce=dev.nonce, measurements=dev.measurements, cc_mode=dev.cc_mode,
                             timestamp=dev.timestamp)
    return StagedAttestation(evidence=evidence, nonce=nonce, root=dev.ca.root, crl=dev.ca.crl(), policy=policy,
                             expected_code=measurements.code)


def run_emulated_attestation(
    state_dir: Path,
    *,
    inject: str | None = None,
    policy: Policy | None = None,
    verifier_secret: bytes | None = None,
) -> AttestationResult:
    """Provision (or load) the emulated vendor and device, attest with a fresh nonce, and verify.

    ``inject`` (one of ``INJECTIONS``) makes the device or the vendor misbehave in memory; the
    persisted PKI under ``state_dir`` is never changed by it.
    """
    staged = stage_emulated_attestation(state_dir, inject=inject, policy=policy)
    return staged.verify(verifier_secret=verifier_secret)
