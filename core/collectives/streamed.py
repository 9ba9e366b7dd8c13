"""One ring hop sealed and opened in pieces, through cache-resident buffers: still one AES-GCM message per hop.

``seal_and_send`` seals a hop piece by piece into a few small send slots reused round robin (``SendSlots``) and
posts each piece on the wire as soon as it is sealed, so the seal writes into the cache and the wire's copy reads
from it, instead of the whole hop's ciphertext being written to a hop-sized buffer and read back. ``open_add``
opens a received hop piece by piece into a small reused scratch and adds each piece into the accumulator while it
is still in the cache, instead of opening the whole hop into a hop-sized scratch and adding that.

The nonce, the AAD and the tag are ``HopSealer.seal_into``'s: the receiver of a streamed hop may open it whole, and
the other way round (the wire's cut, ``parts.piece_ranges``, is the same on both ends). ``open_add`` releases each
piece's plaintext into the accumulator before the tag is checked at the end: a bad tag raises ``TagError`` and the
call's agreement zeroes the tensor on every rank, as for any rejected hop, so no rank returns an unauthenticated sum.
Measured in docs/collectives.md (session 12).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from cryptography.exceptions import InvalidTag

from gputravel.core.collectives.crypto import TAG_LEN, HopAad, HopOpener, HopSealer, rejected
from gputravel.core.collectives.parts import Wire, piece_ranges

__all__ = ["OPEN_PIECE_BYTES", "SEAL_SLOTS", "SEAL_SLOT_BYTES", "SendSlots", "open_add", "seal_and_send"]

#: a streamed hop's wire piece and the size of each send slot (the hop's receiver cuts its receive the same way)
SEAL_SLOT_BYTES = 1 << 20
#: send slots reused round robin: a slot is resealed once its previous piece's send has completed
SEAL_SLOTS = 4
#: ``open_add``'s piece: opened into a scratch of this size and added while it is in the L2 cache
OPEN_PIECE_BYTES = 256 << 10
_SLACK = 32  # update_into wants its output at least one block longer than its input; and the tag's 16 bytes


class SendSlots:
    """A few reused send buffers of ``piece_bytes`` (+ slack), round robin, each with its last send."""

    __slots__ = ("bufs", "arrays", "works", "next")

    def __init__(self, piece_bytes: int = SEAL_SLOT_BYTES, count: int = SEAL_SLOTS) -> None:
        self.bufs = [torch.empty(piece_bytes + _SLACK, dtype=torch.uint8) for _ in range(count)]
        self.arrays = [b.numpy() for b in self.bufs]
        self.works: list[Any] = [None] * count
        self.next = 0

    def ensure(self, piece_bytes: int) -> None:
        """Grow every slot to hold a ``piece_bytes`` piece (a hop over ``MAX_PIECES`` slots cuts larger pieces)."""
        if self.bufs[0].numel() < piece_bytes + _SLACK:
            self.drain()
            self.bufs = [torch.empty(piece_bytes + _SLACK, dtype=torch.uint8) for _ in self.bufs]
            self.arrays = [b.numpy() for b in self.bufs]

    def take(self) -> int:
        """The next slot, once the send it last carried has completed."""
        j = self.next
        self.next = (j + 1) % len(self.bufs)
        work = self.works[j]
        if work is not None:
            work.wait()
            self.works[j] = None
        return j

    def drain(self) -> None:
        """Wait for every send still in flight from a slot."""
        for j, work in enumerate(self.works):
            if work is not None:
                work.wait()
                self.works[j] = None


def seal_and_send(sealer: HopSealer, seq: int, aad: HopAad, plaintext: Any, wire: Wire, tag: int,
                  slots: SendSlots, *, piece_bytes: int = SEAL_SLOT_BYTES) -> tuple[float, float]:
    """Seal ``plaintext`` (a uint8 array) as one hop, piece by piece into ``slots``, sending each piece as soon as
    it is sealed; the message is ``len(plaintext) + TAG_LEN`` bytes cut by ``piece_ranges(.., piece_bytes)``.
    Returns (seconds sealing, seconds on the wire: waiting for a slot, posting a piece). The last sends are left in flight (``slots.drain``)."""
    n = len(plaintext)
    enc = sealer.encryptor(seq, aad)
    tag_bytes: bytes | None = None
    crypto = waited = 0.0
    cut = piece_ranges(n + TAG_LEN, piece_bytes)
    slots.ensure(max(m for _, m in cut))
    for i, (o, m) in enumerate(cut):
        t0 = time.perf_counter()
        j = slots.take()
        t1 = time.perf_counter()
        buf = slots.arrays[j]
        end = min(o + m, n)
        if end > o:
            enc.update_into(plaintext[o:end], buf)
        if o + m > n:  # this piece carries (part of) the tag: every plaintext byte is sealed by now
            if tag_bytes is None:
                enc.finalize()
                tag_bytes = enc.tag
            start = max(o, n)
            buf[start - o:m] = memoryview(tag_bytes)[start - n:o + m - n]
        t2 = time.perf_counter()
        slots.works[j] = wire.send_piece(slots.bufs[j][:m], tag, i)  # gloo may copy it into the socket here
        crypto += t2 - t1
        waited += t1 - t0 + time.perf_counter() - t2
    return crypto, waited


def open_add(opener: HopOpener, seq: int, aad: HopAad, ciphertext: Any, dst: torch.Tensor, scratch: torch.Tensor,
             *, piece_bytes: int = OPEN_PIECE_BYTES) -> float:
    """Open one hop (``ciphertext``: plaintext bytes then the tag) piece by piece into ``scratch`` (at least
    ``piece_bytes + 32`` bytes) and add each piece into ``dst`` (the hop's range of the accumulator, contiguous).
    Returns the seconds spent adding. A bad tag raises ``TagError`` after the adds (the caller's call then fails
    and zeroes its tensor)."""
    n = len(ciphertext) - TAG_LEN
    esize = dst.element_size()
    piece = max(esize, piece_bytes // esize * esize)
    scratch_np = scratch.numpy()
    dec = opener.decryptor(seq, aad)
    adding = 0.0
    for o in range(0, n, piece):
        m = min(piece, n - o)
        dec.update_into(ciphertext[o:o + m], scratch_np)
        t0 = time.perf_counter()
        dst[o // esize:(o + m) // esize].add_(scratch[:m].view(dst.dtype))
        adding += time.perf_counter() - t0
    try:
        dec.finalize_with_tag(bytes(ciphertext[n:]))
    except InvalidTag:
        raise rejected(aad) from None
    return adding
