"""Per-direction AES-256-GCM cipher states, the AAD packer and the replay window.

One ``SendState`` or ``RecvState`` per direction and epoch (aioquic's CryptoPair, noise's
CipherState): nonce = 4-byte prefix || 64-bit counter, never random, never reused. A sender's
counter advances only after a successful seal; a receiver accepts a sequence number once, inside a
sliding window, and only after the tag verified. A new epoch means a new state (an explicit swap).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.protocol.errors import (
    NonceExhaustedError,
    ReplayError,
    StaleEpochError,
    TagError,
)
from gputravel.core.protocol.keys import DirectionKey

TAG_LEN = 16
COUNTER_MAX = 2**64 - 1


class Direction(IntEnum):
    """Who seals for whom. Part of every AAD, so a message cannot be reflected."""

    ORCH_TO_DEVICE = 1
    DEVICE_TO_ORCH = 2
    HOLDER_TO_DEVICE = 3
    DEVICE_TO_HOLDER = 4


_AAD = struct.Struct(">8s16sIBQQQB")
_AAD_LABEL = b"gtaad-v1"


@dataclass(frozen=True, slots=True)
class Aad:
    """Everything a tag binds besides the plaintext."""

    session_id: bytes
    epoch: int
    direction: int
    seq: int
    offset: int
    length: int
    frame_type: int

    def pack(self) -> bytes:
        """The one AAD packing used everywhere (:func:`pack_aad`)."""
        return pack_aad(self.session_id, self.epoch, self.direction, self.seq, self.offset, self.length,
                        self.frame_type)


def pack_aad(session_id: bytes, epoch: int, direction: int, seq: int, offset: int, length: int,
             frame_type: int) -> bytes:
    """:meth:`Aad.pack` without building the dataclass: the per-chunk path packs one AAD per chunk at each end."""
    return _AAD.pack(_AAD_LABEL, session_id, epoch, direction, seq, offset, length, frame_type)


def nonce(prefix: bytes, counter: int) -> bytes:
    """96-bit nonce: 4-byte prefix || 64-bit big-endian counter."""
    return prefix + counter.to_bytes(8, "big")


class ReplayWindow:
    """Sliding bitmap window (as IPsec/DTLS): each sequence accepted once, old ones refused."""

    __slots__ = ("size", "_top", "_bits")

    def __init__(self, size: int = 1024) -> None:
        if size < 1:
            raise ValueError("window size must be positive")
        self.size = size
        self._top = -1  # highest accepted sequence
        self._bits = 0  # bit i set: sequence (_top - i) accepted

    @property
    def highest(self) -> int:
        return self._top

    def check(self, seq: int) -> None:
        """Raise ``ReplayError`` if ``seq`` was accepted already or is beyond the window's back edge."""
        if seq < 0 or seq > COUNTER_MAX:
            raise ReplayError(f"sequence {seq} out of range")
        if seq > self._top:
            return
        back = self._top - seq
        if back >= self.size:
            raise ReplayError(f"sequence {seq} is older than the replay window ({self.size} behind {self._top})")
        if (self._bits >> back) & 1:
            raise ReplayError(f"sequence {seq} was already accepted")

    def accept(self, seq: int) -> None:
        """Mark ``seq`` accepted (call only after ``check`` and a verified tag)."""
        self.check(seq)
        if seq > self._top:
            shift = seq - self._top
            self._bits = ((self._bits << shift) | 1) & ((1 << self.size) - 1)
            self._top = seq
        else:
            self._bits |= 1 << (self._top - seq)

    def seen(self, seq: int) -> bool:
        if seq > self._top or seq < 0:
            return False
        back = self._top - seq
        return back >= self.size or bool((self._bits >> back) & 1)


class _State:
    __slots__ = ("_aead", "prefix", "epoch", "direction", "session_id", "limit", "fingerprint")

    def __init__(self, key: DirectionKey, *, session_id: bytes, limit: int = COUNTER_MAX) -> None:
        self._aead = AESGCM(key.key)
        self.prefix = key.prefix
        self.epoch = key.epoch
        self.direction = key.direction
        self.session_id = session_id
        self.limit = limit
        self.fingerprint = key.fingerprint

    def aad(self, seq: int, offset: int, length: int, frame_type: int) -> bytes:
        return pack_aad(self.session_id, self.epoch, self.direction, seq, offset, length, frame_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(epoch={self.epoch}, direction={self.direction}, fp={self.fingerprint})"


class SendState(_State):
    """The sealing side of one direction."""

    __slots__ = ("counter",)

    def __init__(self, key: DirectionKey, *, session_id: bytes, limit: int = COUNTER_MAX, start: int = 0) -> None:
        """``start`` > 0 resumes an interrupted transfer at that sequence. Chunks before it were
        acknowledged; chunks from it on are re-sealed from the same plaintext, AAD and nonce, which
        gives the same ciphertext: a nonce is never used for two different messages."""
        super().__init__(key, session_id=session_id, limit=limit)
        if start < 0:
            raise ValueError("start must be >= 0")
        self.counter = start

    def _next(self) -> int:
        if self.counter >= self.limit:
            raise NonceExhaustedError(f"epoch {self.epoch} used all {self.limit} nonces; rotate the key")
        return self.counter

    def seal(self, plaintext: bytes | bytearray | memoryview, *, frame_type: int, offset: int = 0,
             length: int | None = None) -> tuple[int, bytes]:
        """Seal and return ``(seq, ciphertext || tag)``."""
        seq = self._next()
        n = len(plaintext) if length is None else length
        out = self._aead.encrypt(nonce(self.prefix, seq), bytes(plaintext), self.aad(seq, offset, n, frame_type))
        self.counter = seq + 1
        return seq, out

    def seal_into(self, plaintext: bytes | bytearray | memoryview, out: bytearray | memoryview, *,
                  frame_type: int, offset: int = 0, length: int | None = None) -> int:
        """Seal into ``out`` (``len(plaintext) + 16`` bytes) and return the sequence number used."""
        seq = self._next()
        n = len(plaintext) if length is None else length
        self._aead.encrypt_into(nonce(self.prefix, seq), plaintext, self.aad(seq, offset, n, frame_type), out)
        self.counter = seq + 1
        return seq


class RecvState(_State):
    """The opening side of one direction, with its replay window."""

    __slots__ = ("window",)

    def __init__(self, key: DirectionKey, *, session_id: bytes, window: int = 1024,
                 limit: int = COUNTER_MAX) -> None:
        super().__init__(key, session_id=session_id, limit=limit)
        self.window = ReplayWindow(window)

    def _precheck(self, epoch: int, seq: int) -> None:
        if epoch != self.epoch:
            raise StaleEpochError(f"message sealed for epoch {epoch}, this key is epoch {self.epoch}")
        if seq >= self.limit:
            raise NonceExhaustedError(f"sequence {seq} is beyond this key's limit {self.limit}")
        self.window.check(seq)

    def open(self, ciphertext: bytes | bytearray | memoryview, *, seq: int, epoch: int, frame_type: int,
             offset: int = 0, length: int | None = None) -> bytes:
        """Verify and decrypt; the sequence is consumed only when the tag verified."""
        self._precheck(epoch, seq)
        n = len(ciphertext) - TAG_LEN if length is None else length
        try:
            out = self._aead.decrypt(nonce(self.prefix, seq), bytes(ciphertext),
                                     self.aad(seq, offset, n, frame_type))
        except InvalidTag:
            raise TagError(f"authentication failed for sequence {seq} (epoch {epoch})") from None
        self.window.accept(seq)
        return out

    def precheck(self, *, seq: int, epoch: int) -> None:
        """The checks before decryption (epoch, limit, replay window), without consuming anything."""
        self._precheck(epoch, seq)

    def decrypt_into(self, ciphertext: bytes | bytearray | memoryview, out: Any, *, seq: int,
                     frame_type: int, offset: int = 0, length: int | None = None) -> None:
        """Only the AEAD step (thread-safe, releases the GIL); zeroes ``out`` on a bad tag. Callers that
        split the work this way must ``precheck`` before and ``window.accept(seq)`` after, holding their own
        reservation of ``seq`` in between (see the device's data path)."""
        n = len(ciphertext) - TAG_LEN if length is None else length
        try:
            self._aead.decrypt_into(nonce(self.prefix, seq), ciphertext, self.aad(seq, offset, n, frame_type), out)
        except InvalidTag:
            dest = memoryview(out).cast("B")
            dest[:] = bytes(len(dest))
            raise TagError(f"authentication failed for sequence {seq} (epoch {self.epoch})") from None

    def open_into(self, ciphertext: bytes | bytearray | memoryview, out: bytearray | memoryview, *, seq: int,
                  epoch: int, frame_type: int, offset: int = 0, length: int | None = None) -> None:
        """Verify and decrypt into ``out``. On a bad tag ``out`` is zeroed before ``TagError`` is raised,
        so unauthenticated plaintext never stays in the destination."""
        self._precheck(epoch, seq)  # after it, ``epoch`` is this key's epoch
        self.decrypt_into(ciphertext, out, seq=seq, frame_type=frame_type, offset=offset, length=length)
        self.window.accept(seq)
