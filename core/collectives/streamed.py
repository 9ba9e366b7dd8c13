"""A received ring hop opened and added in pieces, through a cache-resident scratch: still one AES-GCM message.

``open_add`` opens a hop piece by piece into a small reused scratch and adds each piece into the accumulator while
it is still in the cache, instead of opening the whole hop into a hop-sized scratch and adding that (one write and
one read of the hop's bytes fewer). The nonce, the AAD and the tag are those ``HopSealer.seal_into`` made. Each
piece's plaintext reaches the accumulator before the tag is checked at the end: a bad tag raises ``TagError`` and
the call's agreement zeroes the tensor on every rank, as for any rejected hop, so no rank returns an
unauthenticated sum. Measured in docs/collectives.md (session 12): sealing into small reused send slots, each piece
sent as sealed, was measured too and was slower, so sealing stays whole.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from cryptography.exceptions import InvalidTag

from gputravel.core.collectives.crypto import TAG_LEN, HopAad, HopOpener, rejected

__all__ = ["OPEN_PIECE_BYTES", "open_add"]

#: ``open_add``'s piece: opened into a scratch of this size and added while it is in the L2 cache
OPEN_PIECE_BYTES = 256 << 10


def open_add(opener: HopOpener, seq: int, aad: HopAad, ciphertext: Any, dst: torch.Tensor, scratch: torch.Tensor,
             *, piece_bytes: int = OPEN_PIECE_BYTES) -> float:
    """Open one hop (``ciphertext``: plaintext bytes then the tag) piece by piece into ``scratch`` (at least
    ``piece_bytes + 16`` bytes: ``update_into`` wants a block more than its input) and add each piece into ``dst``
    (the hop's range of the accumulator, contiguous). Returns the seconds spent adding. A bad tag raises ``TagError`` after the adds (the caller's call then fails
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
