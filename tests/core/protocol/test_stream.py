"""Sealed streams (core.protocol.stream): bounded chunks, in-order opening, every alteration named."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputravel.core.errors import DataError, FrameError, TagError
from gputravel.core.protocol import MAX_PAYLOAD, FrameType, encode_frame
from gputravel.core.protocol.stream import (
    MAX_STREAM_CHUNK,
    StreamHeader,
    StreamOpener,
    StreamSealer,
    open_stream,
    rechunk,
    seal_stream,
    tag_digest,
)

KEY = bytes(range(32))


def _header(chunk: int, seq: int = 1) -> StreamHeader:
    return StreamHeader.new(kind="checkpoint", run_id="run-a", seq=seq, chunk_size=chunk)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=12), chunk=st.integers(1, 4096))
def test_frames_never_exceed_the_limit_and_the_stream_round_trips(sizes: list[int], chunk: int) -> None:
    pieces = [os.urandom(n) for n in sizes]
    header = _header(chunk)
    sealed = list(seal_stream(KEY, header, pieces, trailer=lambda: {"digest": "d"}))
    assert all(len(c) <= chunk + 16 for c in sealed[:-1]) and all(len(c) <= header.max_sealed for c in sealed)
    for c in sealed:  # each fits one frame under the protocol's limit
        encode_frame(FrameType.SEALED, {"i": 0}, c)
    assert b"".join(open_stream(KEY, header, sealed)) == b"".join(pieces)
    opener = StreamOpener(KEY, header)
    for c in sealed[:-1]:
        opener.open(c)
    assert opener.open(sealed[-1], final=True) and opener.finish()["digest"] == "d"


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), max_size=10), chunk=st.integers(1, 1500))
def test_rechunk_cuts_exact_chunks_without_losing_a_byte(sizes: list[int], chunk: int) -> None:
    pieces = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    out = [bytes(c) for c in rechunk(pieces, chunk)]
    assert b"".join(out) == b"".join(pieces)
    assert all(len(c) == chunk for c in out[:-1]) and all(0 < len(c) <= chunk for c in out)


def test_the_largest_declarable_chunk_still_fits_a_frame() -> None:
    assert _header(MAX_STREAM_CHUNK).max_sealed + 16 * 1024 < MAX_PAYLOAD
    with pytest.raises(FrameError, match="chunk size"):
        _header(MAX_STREAM_CHUNK + 1)
    sealer = StreamSealer(KEY, _header(16))
    with pytest.raises(FrameError, match="exceeds"):
        sealer.seal(b"x" * 17)


def _sealed(n_chunks: int = 4, chunk: int = 64) -> tuple[StreamHeader, list[bytes]]:
    header = _header(chunk)
    return header, list(seal_stream(KEY, header, [os.urandom(chunk * n_chunks - 5)]))


def test_a_flipped_bit_names_its_chunk() -> None:
    header, sealed = _sealed()
    sealed[2] = sealed[2][:10] + bytes([sealed[2][10] ^ 1]) + sealed[2][11:]
    with pytest.raises(TagError, match="chunk 2 failed authentication"):
        list(open_stream(KEY, header, sealed, what="ckpt-9"))


def test_reordered_chunks_and_a_foreign_header_are_rejected() -> None:
    header, sealed = _sealed()
    with pytest.raises(TagError, match="chunk 1 failed"):
        list(open_stream(KEY, header, [sealed[0], sealed[2], sealed[1], *sealed[3:]]))
    other = StreamHeader(kind=header.kind, run_id="run-b", seq=header.seq, salt=header.salt,
                         chunk_size=header.chunk_size)
    with pytest.raises(TagError, match="chunk 0"):
        list(open_stream(KEY, other, sealed))
    with pytest.raises(TagError, match="chunk 0"):
        list(open_stream(os.urandom(32), header, sealed))


def test_a_stream_cut_at_a_chunk_boundary_is_truncated_not_accepted() -> None:
    header, sealed = _sealed()
    with pytest.raises(DataError, match="truncated: it ends at chunk 2"):
        list(open_stream(KEY, header, sealed[:2]))
    with pytest.raises(DataError, match="truncated"):
        list(open_stream(KEY, header, []))


def test_an_end_chunk_cannot_be_moved_or_followed() -> None:
    header, sealed = _sealed()
    opener = StreamOpener(KEY, header)
    with pytest.raises(TagError, match="chunk 0"):
        opener.open(sealed[-1], final=True)  # the end chunk at index 0
    opener = StreamOpener(KEY, header)
    for c in sealed[:-1]:
        opener.open(c)
    opener.open(sealed[-1], final=True)
    with pytest.raises(TagError, match="follows the end chunk"):
        opener.open(sealed[0])


def test_the_tag_digest_matches_what_the_sealer_reports() -> None:
    header = _header(32)
    sealer = StreamSealer(KEY, header)
    chunks = [sealer.seal(os.urandom(32)) for _ in range(3)] + [sealer.end()]
    assert tag_digest(header, (c[-16:] for c in chunks)) == sealer.tag_digest
    assert tag_digest(header, (c[-16:] for c in chunks[:-1])) != sealer.tag_digest


def test_a_header_round_trips_and_rejects_junk() -> None:
    header = _header(1024, seq=7)
    assert StreamHeader.from_dict(header.to_dict()) == header
    with pytest.raises(FrameError, match="unknown"):
        StreamHeader.from_dict({**header.to_dict(), "extra": 1})
    with pytest.raises(FrameError, match="salt"):
        StreamHeader.from_dict({**header.to_dict(), "salt": "00"})
    assert "salt" not in repr(header)


def test_a_pre_sealed_chunk_rides_the_control_channel_bound_but_not_re_encrypted() -> None:
    """Checkpoint chunks cross the control link as they are (already sealed under the stream key); the sealed
    control frame binds their length and tag, so a swapped, altered or detached chunk is a TagError."""
    from gputravel.core.handshake import SessionSecrets
    from gputravel.core.protocol.devicelink import ControlChannel

    secrets = SessionSecrets(os.urandom(16), os.urandom(32), os.urandom(32))
    header, chunks = _sealed(n_chunks=3, chunk=64)

    def pair() -> tuple[ControlChannel, ControlChannel]:
        return ControlChannel.for_device(secrets, 0), ControlChannel.for_orchestrator(secrets, 0)

    dev, orch = pair()
    head, ct = dev.seal(FrameType.RESPONSE, {"kind": 0}, chunks[0], attached=True)
    assert len(ct) < 200 and chunks[0] not in ct  # only the header was encrypted
    frame = orch.open(head, ct + chunks[0])
    assert bytes(frame.payload) == chunks[0] and frame.header == {"kind": 0}
    altered = chunks[0][:-1] + bytes([chunks[0][-1] ^ 1])
    for what, attach, drop_a in (("another chunk of the same length", chunks[1], False),
                                 ("its tag altered", altered, False),
                                 ("detached: read as one ciphertext", chunks[0], True)):
        dev, orch = pair()
        head, ct = dev.seal(FrameType.RESPONSE, {"kind": 0}, chunks[0], attached=True)
        outer = {"e": head["e"], "s": head["s"]} if drop_a else head
        with pytest.raises(TagError):
            orch.open(outer, ct + attach)
            pytest.fail(what)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=12), chunk=st.integers(1, 2048))
def test_sealing_pieces_where_they_lie_gives_the_chunks_rechunk_and_seal_into_give(sizes: list[int],
                                                                                     chunk: int) -> None:
    """The device's ring path (``seal_pieces``: each piece encrypted straight into its chunk's slot) writes the
    very bytes the staged path does, so the stream, its tags and a checkpoint file are unchanged; a piece whose
    buffer is reused for the next one (a staging buffer off a GPU) is sealed before it is overwritten."""
    pieces = [os.urandom(n) for n in sizes]
    header = _header(chunk)
    ref = StreamSealer(KEY, header)
    want = [ref.seal(c) for c in rechunk(pieces, chunk)]

    stage = bytearray(max(sizes, default=0))

    def staged() -> Iterator[memoryview]:  # every piece in one reused buffer, valid until the next is asked for
        for p in pieces:
            stage[: len(p)] = p
            yield memoryview(stage)[: len(p)]

    slot = bytearray(header.sealed_size(chunk))
    got: list[bytes] = []
    sealer = StreamSealer(KEY, header)
    sealer.seal_pieces(staged(), lambda: memoryview(slot), lambda n: got.append(bytes(slot[:n])))
    assert got == want
    assert (sealer.index, sealer.bytes, sealer.tag_digest) == (ref.index, ref.bytes, ref.tag_digest)
    assert ref.end({"d": 1}) == sealer.end({"d": 1})
