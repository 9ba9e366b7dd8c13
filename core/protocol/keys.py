"""The key schedule: HKDF-SHA256 labels from a session master to per-epoch, per-direction keys.

A new epoch is a label derivation, never a counter reset under an old key: every (session,
epoch, direction) and every provisioning window has its own AES-256-GCM key and nonce prefix.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_LEN = 32
PREFIX_LEN = 4


def hkdf(ikm: bytes, *, info: bytes, length: int = KEY_LEN, salt: bytes | None = None) -> bytes:
    """HKDF-SHA256 (RFC 5869)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def fingerprint(key: bytes) -> str:
    """A short public name for a key: safe to log, show and store. Never the key itself."""
    return hashlib.sha256(b"gputravel-fp" + bytes(key)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class DirectionKey:
    """Key material of one direction in one epoch. ``repr`` never shows the key."""

    key: bytes
    prefix: bytes
    epoch: int
    direction: int

    def __post_init__(self) -> None:
        if len(self.key) != KEY_LEN or len(self.prefix) != PREFIX_LEN:
            raise ValueError("a direction key is 32 key bytes and a 4-byte nonce prefix")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    def __repr__(self) -> str:
        return f"DirectionKey(epoch={self.epoch}, direction={self.direction}, fp={self.fingerprint})"

    def to_wire(self) -> dict[str, object]:
        """Hex form for hand-off to a holder (travels only inside an encrypted link)."""
        return {"key": self.key.hex(), "prefix": self.prefix.hex(), "epoch": self.epoch,
                "direction": self.direction}

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> DirectionKey:
        return cls(bytes.fromhex(str(data["key"])), bytes.fromhex(str(data["prefix"])),
                   int(str(data["epoch"])), int(str(data["direction"])))


def _derive(master: bytes, label: bytes, session_id: bytes, fields: tuple[int, ...]) -> tuple[bytes, bytes]:
    info = b"gputravel " + label + b" v1|" + session_id + struct.pack(f">{len(fields)}Q", *fields)
    okm = hkdf(master, info=info, length=KEY_LEN + PREFIX_LEN)
    return okm[:KEY_LEN], okm[KEY_LEN:]


def channel_key(master: bytes, session_id: bytes, *, epoch: int, direction: int) -> DirectionKey:
    """Control-channel key for one direction in one epoch."""
    key, prefix = _derive(master, b"channel", session_id, (epoch, direction))
    return DirectionKey(key, prefix, epoch, direction)


def provisioning_key(master: bytes, session_id: bytes, *, epoch: int, offset: int, length: int,
                     direction: int) -> DirectionKey:
    """The key a holder gets for one hand-off: bound to the epoch and to the buffer window."""
    key, prefix = _derive(master, b"provision", session_id, (epoch, offset, length))
    return DirectionKey(key, prefix, epoch, direction)


#: the HKDF label of a data connection's admission key (its own label: the MAC key is never the AEAD key)
ADMIT_LABEL = b"gputravel data-admit v1"
ADMIT_NONCE_LEN = 16
ADMIT_MAC_LEN = 32


def admission_key(provisioning: bytes) -> bytes:
    """The key that admits a data connection for one window: HKDF of that window's provisioning key."""
    return hkdf(provisioning, info=ADMIT_LABEL)


def admission_mac(key: bytes, *, nonce: bytes, session_id: bytes, epoch: int, holder: str) -> bytes:
    """HMAC-SHA256 under ``admission_key`` over (nonce, session, epoch, holder name): proves the speaker
    holds this window's key, for this connection (``nonce``: fresh, never admitted twice in a window)."""
    import hmac

    name = holder.encode()
    msg = (b"admit|" + struct.pack(">H", len(nonce)) + nonce + struct.pack(">H", len(session_id)) + session_id
           + struct.pack(">QH", epoch, len(name)) + name)
    return hmac.new(key, msg, hashlib.sha256).digest()
