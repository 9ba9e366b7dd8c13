"""Device identity, attestation evidence and its verification.

The emulated GPU owns an ECDSA P-384 identity key certified by an emulated vendor PKI
(root CA -> device CA -> device leaf). It signs a report over the verifier's fresh nonce, its
measurements and its confidential-computing mode. The verifier checks the chain against the pinned
vendor root, the vendor's revocation list, the report signature, the nonce and its age, the
measurements against a policy (the reference-integrity manifest) and the mode. Verification fails
closed: bad evidence yields failed claims, never an exception.

Modules, bottom up: ``pki`` (vendor root and device CA, certificates, CRL, device identity),
``evidence`` (measurements, the signed report), ``policy`` (the reference values, from
``core/policy/*.toml``), ``result`` (the claims, the result, the token), ``verify`` (one check per claim)
and ``inject`` (the emulated run and its faults). Everything public is re-exported here.

Keys are never printed, logged or put in messages: only ``fingerprint``s are.
"""

from __future__ import annotations

from gputravel.core.attestation.evidence import (
    EMULATED_DRIVER,
    EMULATED_FIRMWARE,
    PLATFORM_EMULATED,
    REPORT_VERSION,
    CCMode,
    Evidence,
    Measurements,
    code_measurement,
    emulated_measurements,
    make_evidence,
)
from gputravel.core.attestation.inject import INJECTIONS, Injection, run_emulated_attestation
from gputravel.core.attestation.pki import (
    DeviceIdentity,
    VendorCA,
    fingerprint,
    provision_emulated,
    public_key_fingerprint,
)
from gputravel.core.attestation.policy import Policy, load_policy
from gputravel.core.attestation.result import AttestationResult, AttestationToken, Claim
from gputravel.core.attestation.verify import CLAIM_NAMES, MAX_CLOCK_SKEW_S, verify_evidence

__all__ = [
    "CLAIM_NAMES",
    "EMULATED_DRIVER",
    "EMULATED_FIRMWARE",
    "INJECTIONS",
    "MAX_CLOCK_SKEW_S",
    "PLATFORM_EMULATED",
    "REPORT_VERSION",
    "AttestationResult",
    "AttestationToken",
    "CCMode",
    "Claim",
    "DeviceIdentity",
    "Evidence",
    "Injection",
    "Measurements",
    "Policy",
    "VendorCA",
    "code_measurement",
    "emulated_measurements",
    "fingerprint",
    "load_policy",
    "make_evidence",
    "provision_emulated",
    "public_key_fingerprint",
    "run_emulated_attestation",
    "verify_evidence",
]
