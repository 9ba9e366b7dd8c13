"""A ring hop opened and added in pieces (``streamed.open_add``) is the hop ``seal_into`` sealed whole; the wire's cut.

Single-process units with real AES-256-GCM keys. The multi-rank schedules that use ``open_add`` (naive and direct)
are pinned bit-equal to ``dist.all_reduce`` and tamper- and replay-evident in test_collectives.py.
"""

from __future__ import annotations

import pytest
import torch

from gputravel.core.collectives.crypto import TAG_LEN, HopAad, HopOpener, HopSealer, Phase
from gputravel.core.collectives.parts import MAX_PIECES, piece_ranges
from gputravel.core.collectives.streamed import open_add
from gputravel.core.protocol import TagError, channel_key

PIECE = 4096


def _pair() -> tuple[HopSealer, HopOpener]:
    key = channel_key(bytes(range(32)), bytes(16), epoch=0, direction=1)
    return HopSealer(key, session_id=bytes(16)), HopOpener(key, session_id=bytes(16))


def _aad(n: int) -> HopAad:
    return HopAad(bytes(16), epoch=0, iteration=5, phase=Phase.REDUCE_SCATTER, step=0, chunk=0, src=0, dst=1,
                  offset=0, length=n)


def test_streamed_open_adds_the_plaintext_and_refuses_a_flipped_byte_or_another_nonce() -> None:
    sealer, opener = _pair()
    peer = torch.randn(3 * PIECE // 4 + 5)
    n = peer.numel() * 4
    ct = torch.empty(n + TAG_LEN, dtype=torch.uint8)
    sealer.seal_into(9, peer.view(torch.uint8).numpy(), ct.numpy(), _aad(n))
    acc = torch.randn(peer.numel())
    want = acc + peer
    scratch = torch.empty(PIECE + TAG_LEN, dtype=torch.uint8)
    open_add(opener, 9, _aad(n), ct.numpy(), acc, scratch, piece_bytes=PIECE)
    assert torch.equal(acc, want)
    bad = ct.clone()
    bad[n // 2] ^= 1
    with pytest.raises(TagError, match="ring hop rejected"):
        open_add(opener, 9, _aad(n), bad.numpy(), torch.zeros(peer.numel()), scratch, piece_bytes=PIECE)
    with pytest.raises(TagError):
        open_add(opener, 10, _aad(n), ct.numpy(), torch.zeros(peer.numel()), scratch, piece_bytes=PIECE)


def test_piece_ranges_cover_the_message_once_in_at_most_max_pieces() -> None:
    for nbytes, piece in ((10, 4), (PIECE, PIECE), (PIECE + 1, PIECE), (100 * PIECE + 3, PIECE)):
        cut = piece_ranges(nbytes, piece)
        assert len(cut) <= MAX_PIECES
        assert [o for o, _ in cut] == [sum(m for _, m in cut[:i]) for i in range(len(cut))]
        assert sum(m for _, m in cut) == nbytes
