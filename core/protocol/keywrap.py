"""The key exchange between a holder and the orchestrator's CVM: how a provisioning key reaches an
attesting holder (issue 22 item 5).

Each side has an X25519 key: the orchestrator one per run (its public half is bound into the CVM's TDX quote:
``report_data = cvm_report_data(public, run_id)``), the agent one per process (its public half rides in
HELLO). A provisioning key travels to an attesting holder wrapped under HKDF-SHA256(X25519(...)) with
AES-256-GCM, its epoch and fingerprint as associated data: only the holder of the CVM's attested private key
could have wrapped it, and only this agent can unwrap it. Standard library and ``cryptography`` only.
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gputravel.core.protocol.errors import FrameError

__all__ = ["MAX_PEERS", "LinkKey", "conventional_secret", "cvm_report_data", "spdm_nonce", "unwrap_key", "wrap_key"]

_WRAP_INFO = b"gputravel-holder-key-wrap-v1"
_CONVENTIONAL_INFO = b"gputravel-holder-conventional-v1"
_NONCE_LEN = 12


def cvm_report_data(link_public: bytes, run_id: str) -> bytes:
    """The 64 bytes of TDX report data that bind the CVM's key-exchange key and the run."""
    return hashlib.sha512(b"gputravel-cvm-report-data-v1\0" + link_public + b"\0" + run_id.encode()).digest()


def spdm_nonce(holder_nonce: bytes, key_fingerprint: str, epoch: int) -> bytes:
    """The 32-byte SPDM request nonce of one hand-off: the holder's fresh nonce bound to the window's key."""
    return hashlib.sha256(b"gputravel-holder-spdm-v1\0" + holder_nonce + key_fingerprint.encode()
                          + epoch.to_bytes(8, "big")).digest()


#: peers whose exchange a ``LinkKey`` keeps (an orchestrator's key meets one peer per holder; beyond this, the
#: oldest is forgotten and derived again when it comes back)
MAX_PEERS = 4096


class LinkKey:
    """One side's X25519 key for the key exchange.

    The exchange with a peer and the wrap key derived from it are the same at every hand-off (both keys live as
    long as the run or the agent), so each is computed once per peer and kept (issue 34: an X25519 exchange and
    an HKDF took 0.2-0.8 ms on each side of every hand-off, on its critical path). ``prepare`` computes them
    ahead (the agent as it verifies an ATTEST, the orchestrator at HELLO), off the hand-off's path."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._shared: dict[bytes, bytes] = {}
        self._wraps: dict[tuple[bytes, bytes], AESGCM] = {}

    def shared(self, peer_public: bytes) -> bytes:
        """X25519 with ``peer_public`` (kept per peer), or ``FrameError`` when it is not an X25519 public key."""
        got = self._shared.get(peer_public)
        if got is None:
            try:
                peer = X25519PublicKey.from_public_bytes(peer_public)
            except ValueError:
                raise FrameError("the peer's key-exchange key is not an X25519 public key") from None
            got = self._key.exchange(peer)
            if len(self._shared) >= MAX_PEERS:
                self._shared.pop(next(iter(self._shared)))
            self._shared[peer_public] = got
        return got

    def _aead(self, peer_public: bytes, context: bytes) -> AESGCM:
        aead = self._wraps.get((peer_public, context))
        if aead is None:
            key = HKDF(hashes.SHA256(), 32, salt=None,
                       info=_WRAP_INFO + b"\0" + context).derive(self.shared(peer_public))
            aead = AESGCM(key)
            if len(self._wraps) >= MAX_PEERS:
                self._wraps.pop(next(iter(self._wraps)))
            self._wraps[(peer_public, context)] = aead
        return aead

    def prepare(self, peer_public: bytes, context: bytes) -> None:
        """Derive the wrap key with ``peer_public`` for ``context`` now (a later ``wrap_key``/``unwrap_key`` finds
        it kept); a malformed peer key is left for that call to name."""
        try:
            self._aead(peer_public, context)
        except FrameError:
            pass


def _aad(epoch: int, fingerprint: str) -> bytes:
    return epoch.to_bytes(8, "big") + fingerprint.encode()


def wrap_key(own: LinkKey, peer_public: bytes, context: bytes, secret: bytes, *, epoch: int,
             fingerprint: str) -> str:
    """``secret`` (the key and its nonce prefix) sealed for ``peer_public``; hex of nonce || ciphertext."""
    nonce = os.urandom(_NONCE_LEN)
    return (nonce + own._aead(peer_public, context).encrypt(nonce, secret, _aad(epoch, fingerprint))).hex()


def unwrap_key(own: LinkKey, peer_public: bytes, context: bytes, wrapped_hex: str, *, epoch: int,
               fingerprint: str) -> bytes:
    """The secret ``wrap_key`` sealed, or ``FrameError`` when it was not sealed by ``peer_public`` for us."""
    try:
        raw = bytes.fromhex(wrapped_hex)
    except ValueError:
        raise FrameError("the wrapped key is not hex") from None
    try:
        return own._aead(peer_public, context).decrypt(raw[:_NONCE_LEN], raw[_NONCE_LEN:], _aad(epoch, fingerprint))
    except (InvalidTag, ValueError):
        raise FrameError("the wrapped key does not open under the attested CVM's key exchange") from None


def conventional_secret(own: LinkKey, peer_public: bytes, run_id: str, epoch: int) -> bytes:
    """The 36 bytes (AES-256-GCM key ‖ 4-byte nonce prefix) a conventional hand-off's data is sealed under, to the
    attested CVM (issue 30): HKDF-SHA256 over the same X25519 exchange as the wrapped key, bound to the run and the
    epoch. Either side derives it (the agent with its key and the CVM's public one, the CVM the other way round);
    nobody else on the link can open the data."""
    info = _CONVENTIONAL_INFO + b"\0" + run_id.encode() + b"\0" + epoch.to_bytes(8, "big")
    return HKDF(hashes.SHA256(), 36, salt=None, info=info).derive(own.shared(peer_public))
