"""What a verification yields: every ``Claim`` (a checked property, true or false with its reason), the
``AttestationResult`` they add up to, and, only for a device that passed, an ``AttestationToken`` (the
verifier's statement, MACed with its secret, valid until it expires). ``verify`` produces them; the device
client hands them to the orchestrator's device session, and ``gputravel attest`` prints them.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.core.attestation.evidence import PLATFORM_EMULATED, CCMode, Measurements, canonical_json
from gputravel.core.errors import AttestationError

__all__ = ["AttestationResult", "AttestationToken", "Claim"]


@dataclass(frozen=True, slots=True)
class Claim:
    """One checked property of the evidence."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class AttestationToken:
    """The verifier's statement that a device passed attestation, MACed with the verifier's secret."""

    device_id: str
    measurement_digest: str
    claims_digest: str
    evidence_digest: str
    issued_at: float
    expires_at: float
    signature: bytes = field(repr=False)

    def _payload(self) -> bytes:
        body = self.to_dict()
        del body["signature"]
        return canonical_json(body)

    @classmethod
    def issue(
        cls,
        secret: bytes,
        *,
        device_id: str,
        measurement_digest: str,
        claims_digest: str,
        evidence_digest: str,
        issued_at: float,
        ttl_s: float,
    ) -> AttestationToken:
        unsigned = cls(device_id, measurement_digest, claims_digest, evidence_digest, issued_at,
                       issued_at + ttl_s, b"")
        return dataclasses.replace(unsigned, signature=hmac.digest(secret, unsigned._payload(), "sha256"))

    def is_valid(self, now: float | None = None) -> bool:
        """True while ``issued_at <= now < expires_at`` (the MAC is checked by ``verify``)."""
        now = time.time() if now is None else now
        return self.issued_at <= now < self.expires_at

    def verify(self, secret: bytes, *, now: float | None = None) -> bool:
        """True when the MAC matches ``secret`` and the token has not expired."""
        good = hmac.compare_digest(hmac.digest(secret, self._payload(), "sha256"), self.signature)
        return good and self.is_valid(now)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "measurement_digest": self.measurement_digest,
            "claims_digest": self.claims_digest,
            "evidence_digest": self.evidence_digest,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "signature": self.signature.hex(),
        }


@dataclass(frozen=True)
class AttestationResult:
    """Every claim, the verdict, and (only when ``ok``) a token and the device's public key."""

    claims: tuple[Claim, ...]
    ok: bool
    token: AttestationToken | None
    device_public_key: ec.EllipticCurvePublicKey | None = field(repr=False)
    device_id: str | None
    measurements: Measurements | None
    cc_mode: CCMode | None
    platform: str = PLATFORM_EMULATED
    device_key_fingerprint: str | None = None

    def claim(self, name: str) -> Claim:
        for c in self.claims:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def failed(self) -> tuple[Claim, ...]:
        return tuple(c for c in self.claims if not c.ok and c.name != "overall")

    def raise_for_failure(self) -> None:
        """Raise ``AttestationError`` naming every failed claim, or return when all passed."""
        if self.ok:
            return
        failed = self.failed or tuple(c for c in self.claims if not c.ok)
        reasons = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        raise AttestationError(f"attestation of {self.device_id or 'unknown device'} failed: {reasons}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary; public-key fingerprint only, no key material."""
        return {
            "ok": self.ok,
            "platform": self.platform,
            "device_id": self.device_id,
            "device_key_fingerprint": self.device_key_fingerprint,
            "cc_mode": None if self.cc_mode is None else self.cc_mode.value,
            "measurements": None if self.measurements is None else self.measurements.to_dict(),
            "claims": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.claims},
            "token": None if self.token is None else self.token.to_dict(),
        }
