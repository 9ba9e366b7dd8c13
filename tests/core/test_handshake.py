"""Session set-up: ECDH P-384 authenticated by the device identity key over the transcript."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.core.errors import AttestationError
from gputravel.core.handshake import Initiator, SessionSecrets, respond

CONTEXT = b"nonce+evidence-digest"


@pytest.fixture(scope="module")
def device_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def _flip(data: bytes, i: int = -1) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x01
    return bytes(b)


def test_both_sides_derive_equal_secrets(device_key: ec.EllipticCurvePrivateKey) -> None:
    initiator = Initiator(context=CONTEXT)
    device_public, signature, device_secrets = respond(
        device_key, initiator_public=initiator.public_bytes(), context=CONTEXT
    )

    secrets = initiator.finish(device_public=device_public, signature=signature,
                               device_key=device_key.public_key())

    assert secrets == device_secrets
    assert len(secrets.session_id) == 16 and len(secrets.master) == 32 and len(secrets.transcript_hash) == 32
    assert secrets.fingerprint() == device_secrets.fingerprint()


def test_two_sessions_derive_different_secrets(device_key: ec.EllipticCurvePrivateKey) -> None:
    results = []
    for _ in range(2):
        initiator = Initiator(context=CONTEXT)
        pub, sig, _secrets = respond(device_key, initiator_public=initiator.public_bytes(), context=CONTEXT)
        results.append(initiator.finish(device_public=pub, signature=sig, device_key=device_key.public_key()))

    assert results[0].master != results[1].master and results[0].session_id != results[1].session_id


def test_signature_from_another_key_is_rejected(device_key: ec.EllipticCurvePrivateKey) -> None:
    impostor = ec.generate_private_key(ec.SECP384R1())
    initiator = Initiator(context=CONTEXT)
    pub, sig, _ = respond(impostor, initiator_public=initiator.public_bytes(), context=CONTEXT)

    with pytest.raises(AttestationError, match="session signature"):
        initiator.finish(device_public=pub, signature=sig, device_key=device_key.public_key())


def test_substituted_device_public_key_is_rejected(device_key: ec.EllipticCurvePrivateKey) -> None:
    initiator = Initiator(context=CONTEXT)
    _pub, sig, _ = respond(device_key, initiator_public=initiator.public_bytes(), context=CONTEXT)
    mitm = Initiator(context=CONTEXT).public_bytes()  # a valid point the device never sent

    with pytest.raises(AttestationError, match="session signature"):
        initiator.finish(device_public=mitm, signature=sig, device_key=device_key.public_key())


def test_different_context_is_rejected(device_key: ec.EllipticCurvePrivateKey) -> None:
    initiator = Initiator(context=CONTEXT)
    pub, sig, _ = respond(device_key, initiator_public=initiator.public_bytes(), context=b"another nonce")

    with pytest.raises(AttestationError, match="session signature"):
        initiator.finish(device_public=pub, signature=sig, device_key=device_key.public_key())


def test_context_changes_the_derived_secrets(device_key: ec.EllipticCurvePrivateKey) -> None:
    initiator = Initiator(context=CONTEXT)
    *_, a = respond(device_key, initiator_public=initiator.public_bytes(), context=b"context a")
    *_, b = respond(device_key, initiator_public=initiator.public_bytes(), context=b"context b")

    assert a.transcript_hash != b.transcript_hash and a.master != b.master


@pytest.mark.parametrize(
    "point",
    [b"", b"\x04" + b"\x00" * 96, _flip(Initiator(context=b"").public_bytes()), b"\x05" * 97],
    ids=["empty", "zero-point", "off-curve", "bad-prefix"],
)
def test_malformed_points_raise_attestation_error(device_key: ec.EllipticCurvePrivateKey, point: bytes) -> None:
    with pytest.raises(AttestationError, match="not a valid P-384 point"):
        respond(device_key, initiator_public=point, context=CONTEXT)

    initiator = Initiator(context=CONTEXT)
    with pytest.raises(AttestationError, match="not a valid P-384 point"):
        initiator.finish(device_public=point, signature=b"x", device_key=device_key.public_key())


def test_an_initiator_cannot_be_finished_twice(device_key: ec.EllipticCurvePrivateKey) -> None:
    initiator = Initiator(context=CONTEXT)
    pub, sig, _ = respond(device_key, initiator_public=initiator.public_bytes(), context=CONTEXT)
    initiator.finish(device_public=pub, signature=sig, device_key=device_key.public_key())

    with pytest.raises(AttestationError, match="already used"):
        initiator.finish(device_public=pub, signature=sig, device_key=device_key.public_key())


def test_secrets_repr_shows_no_key_bytes() -> None:
    secrets = SessionSecrets(session_id=b"\x11" * 16, master=b"\x22" * 32, transcript_hash=b"\x33" * 32)

    text = repr(secrets)

    assert "22222222" not in text and "\\x22" not in text and "1111" not in text
    assert secrets.fingerprint() in text
