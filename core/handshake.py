"""Session set-up: ephemeral ECDH P-384, authenticated by the device's identity key over the transcript.

The orchestrator (``Initiator``) sends an ephemeral public key; the device (``respond``) answers with
its own ephemeral public key and an ECDSA-SHA384 signature by its identity key over the transcript::

    transcript = b"gputravel-session-v1" || lp(context) || lp(initiator_public) || lp(device_public)

where ``lp(x)`` is a 4-byte big-endian length followed by ``x``, and ``context`` is what the caller
binds (the attestation nonce and evidence digest). Both sides derive, with HKDF-SHA256 over the ECDH
secret and ``salt = SHA-256(transcript)``, a 32-byte master secret and a 16-byte session id.

The transcript's label keeps these signatures apart from attestation reports (canonical JSON, which
starts with ``{``), though the same identity key signs both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gputravel.core.attestation import fingerprint
from gputravel.core.errors import AttestationError

__all__ = ["TRANSCRIPT_LABEL", "Initiator", "SessionSecrets", "respond", "transcript"]

TRANSCRIPT_LABEL = b"gputravel-session-v1"
_MASTER_INFO = b"gputravel master v1"
_SESSION_ID_INFO = b"gputravel session id v1"
_CURVE = ec.SECP384R1


@dataclass(frozen=True, slots=True)
class SessionSecrets:
    """What both ends of a session share. ``repr`` shows fingerprints, never the bytes."""

    session_id: bytes
    master: bytes
    transcript_hash: bytes

    def fingerprint(self) -> str:
        """Fingerprint of the master secret (safe to log)."""
        return str(fingerprint(self.master))

    def __repr__(self) -> str:
        return f"SessionSecrets(session={fingerprint(self.session_id)}, master={self.fingerprint()})"


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def transcript(*, context: bytes, initiator_public: bytes, device_public: bytes) -> bytes:
    """The bytes the device signs and both sides hash into the key derivation."""
    return TRANSCRIPT_LABEL + _lp(context) + _lp(initiator_public) + _lp(device_public)


def _public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def _load_point(data: bytes, who: str) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(_CURVE(), bytes(data))
    except (ValueError, TypeError):
        raise AttestationError(f"session handshake: the {who} public key is not a valid P-384 point") from None


def _derive(shared: bytes, transcript_bytes: bytes) -> SessionSecrets:
    th = hashlib.sha256(transcript_bytes).digest()
    master = HKDF(algorithm=hashes.SHA256(), length=32, salt=th, info=_MASTER_INFO).derive(shared)
    session_id = HKDF(algorithm=hashes.SHA256(), length=16, salt=th, info=_SESSION_ID_INFO).derive(shared)
    return SessionSecrets(session_id=session_id, master=master, transcript_hash=th)


class Initiator:
    """The orchestrator's side of one session set-up; single use."""

    __slots__ = ("_context", "_key", "_public")

    def __init__(self, *, context: bytes) -> None:
        self._context = bytes(context)
        self._key: ec.EllipticCurvePrivateKey | None = ec.generate_private_key(_CURVE())
        self._public = _public_bytes(self._key)

    def __repr__(self) -> str:
        return f"Initiator(ephemeral={fingerprint(self._public)})"

    def public_bytes(self) -> bytes:
        """The ephemeral public key (X9.62 uncompressed point) to send to the device."""
        return self._public

    def finish(
        self, *, device_public: bytes, signature: bytes, device_key: ec.EllipticCurvePublicKey
    ) -> SessionSecrets:
        """Verify the device's signature over the transcript with its attested key, then derive secrets.

        Raises ``AttestationError`` for an invalid point, a wrong key type, or a signature that does not
        verify. The ephemeral key is discarded either way.
        """
        key, self._key = self._key, None
        if key is None:
            raise AttestationError("session handshake: this initiator was already used")
        if not isinstance(device_key, ec.EllipticCurvePublicKey) or not isinstance(device_key.curve, _CURVE):
            raise AttestationError("session signature cannot be checked: the device key is not P-384")
        peer = _load_point(device_public, "device")
        data = transcript(context=self._context, initiator_public=self._public, device_public=bytes(device_public))
        try:
            device_key.verify(bytes(signature), data, ec.ECDSA(hashes.SHA384()))
        except InvalidSignature:
            raise AttestationError("session signature does not verify under the attested device key") from None
        return _derive(key.exchange(ec.ECDH(), peer), data)


def respond(
    identity_key: ec.EllipticCurvePrivateKey, *, initiator_public: bytes, context: bytes
) -> tuple[bytes, bytes, SessionSecrets]:
    """The device's side: returns (device ephemeral public bytes, signature, secrets)."""
    peer = _load_point(initiator_public, "initiator")
    ephemeral = ec.generate_private_key(_CURVE())
    device_public = _public_bytes(ephemeral)
    data = transcript(context=bytes(context), initiator_public=bytes(initiator_public), device_public=device_public)
    signature = identity_key.sign(data, ec.ECDSA(hashes.SHA384()))
    return device_public, signature, _derive(ephemeral.exchange(ec.ECDH(), peer), data)
