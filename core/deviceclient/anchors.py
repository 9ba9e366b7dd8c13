"""What the orchestrator pins to trust a device (the platform supplies it, the client verifies with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

    from gputravel.core.attestation import Policy

__all__ = ["TrustAnchors"]


@dataclass(frozen=True, slots=True)
class TrustAnchors:
    """What the orchestrator pins: the vendor root, the revocation list, the policy."""

    root: x509.Certificate
    crl: x509.CertificateRevocationList | None
    policy: Policy
