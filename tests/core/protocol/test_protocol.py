"""core.protocol: frames, cipher states, AAD binding, replay window, key schedule."""

from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputravel.core.protocol import (
    TAG_LEN,
    Direction,
    FrameDecoder,
    FrameError,
    FrameType,
    NonceExhaustedError,
    RecvState,
    ReplayError,
    ReplayWindow,
    SendState,
    StaleEpochError,
    TagError,
    channel_key,
    decode_frame,
    encode_frame,
    fingerprint,
    provisioning_key,
    read_frame,
    write_frame,
)
from gputravel.core.protocol.frames import MAX_HEADER, PREFIX, frame_head

SID = b"S" * 16
MASTER = bytes(range(32))


def pair(epoch: int = 1, window: int = 64, limit: int = 2**64 - 1) -> tuple[SendState, RecvState]:
    key = provisioning_key(MASTER, SID, epoch=epoch, offset=0, length=1 << 20, direction=Direction.HOLDER_TO_DEVICE)
    return SendState(key, session_id=SID, limit=limit), RecvState(key, session_id=SID, window=window, limit=limit)


# --- frames -----------------------------------------------------------------------------------
def test_frame_round_trips_type_header_and_payload():
    raw = encode_frame(FrameType.CHUNK, {"s": 3, "o": 4096}, b"\x00\x01payload")
    frame = decode_frame(raw)
    assert frame.type is FrameType.CHUNK
    assert frame.header == {"s": 3, "o": 4096}
    assert frame.payload == b"\x00\x01payload"


def test_truncated_frame_is_rejected():
    raw = encode_frame(FrameType.HELLO, {"a": 1}, b"xyz")
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(raw[:-1])
    with pytest.raises(FrameError, match="truncated"):
        read_frame(io.BytesIO(raw[:-2]))


def test_oversized_frame_is_rejected_before_reading_its_payload():
    head = PREFIX.pack(b"GT", 1, int(FrameType.CHUNK), 0, 64 * 1024 * 1024)
    with pytest.raises(FrameError, match="exceeds"):
        read_frame(io.BytesIO(head))
    with pytest.raises(FrameError, match="exceeds"):
        encode_frame(FrameType.CHUNK, {}, b"x" * 100, max_payload=10)
    with pytest.raises(FrameError, match="header"):
        encode_frame(FrameType.HELLO, {"x": "y" * (MAX_HEADER + 1)})


def test_unknown_frame_type_and_bad_magic_are_rejected():
    with pytest.raises(FrameError, match="unknown frame type"):
        decode_frame(PREFIX.pack(b"GT", 1, 250, 0, 0))
    with pytest.raises(FrameError, match="magic"):
        decode_frame(PREFIX.pack(b"XX", 1, 1, 0, 0))
    with pytest.raises(FrameError, match="JSON object"):
        decode_frame(PREFIX.pack(b"GT", 1, 1, 2, 0) + b"[]")


def test_stream_decoder_splits_frames_fed_byte_by_byte():
    raws = [encode_frame(FrameType.ACK, {"s": i}) for i in range(5)]
    decoder = FrameDecoder()
    got = []
    for byte in b"".join(raws):
        got += decoder.feed(bytes([byte]))
    assert [f.header["s"] for f in got] == [0, 1, 2, 3, 4]
    decoder.eof()
    decoder.feed(raws[0][:5])
    with pytest.raises(FrameError, match="inside a frame"):
        decoder.eof()


def test_read_frame_returns_none_on_clean_end_and_reads_what_write_frame_wrote():
    buf = io.BytesIO()
    write_frame(buf, FrameType.DONE, {"n": 2}, memoryview(b"ab"))
    buf.seek(0)
    frame = read_frame(buf)
    assert frame is not None and frame.payload == b"ab"
    assert read_frame(buf) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_bytes_either_decode_or_raise_frame_error(data):
    try:
        frames = FrameDecoder().feed(data)
    except FrameError:
        return
    for frame in frames:
        assert isinstance(frame.type, FrameType)
        assert isinstance(frame.header, dict)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(FrameType)), st.dictionaries(st.text(max_size=8), st.integers(), max_size=4),
       st.binary(max_size=300), st.integers(min_value=0, max_value=400))
def test_fuzzed_mutations_of_a_valid_frame_never_crash_the_decoder(ftype, header, payload, pos):
    raw = bytearray(encode_frame(ftype, header, payload))
    raw[pos % len(raw)] ^= 0x5A
    try:
        decode_frame(bytes(raw))
    except FrameError:
        pass


# --- cipher states ----------------------------------------------------------------------------
def test_sealed_chunk_opens_into_a_preallocated_buffer():
    send, recv = pair()
    plain = os.urandom(4096)
    out_ct = bytearray(len(plain) + TAG_LEN)
    seq = send.seal_into(plain, out_ct, frame_type=FrameType.CHUNK, offset=8192)
    dest = bytearray(len(plain))
    recv.open_into(out_ct, dest, seq=seq, epoch=1, frame_type=FrameType.CHUNK, offset=8192)
    assert bytes(dest) == plain
    assert send.counter == 1 and recv.window.highest == 0


def test_tampered_ciphertext_is_rejected_and_destination_zeroed():
    send, recv = pair()
    seq, ct = send.seal(b"secret data" * 10, frame_type=FrameType.CHUNK)
    bad = bytearray(ct)
    bad[5] ^= 1
    dest = bytearray(len(ct) - TAG_LEN)
    with pytest.raises(TagError):
        recv.open_into(bad, dest, seq=seq, epoch=1, frame_type=FrameType.CHUNK)
    assert dest == bytearray(len(dest))
    # the sequence was not consumed: the genuine chunk still opens
    assert recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK) == b"secret data" * 10


@pytest.mark.parametrize("field", ["offset", "frame_type", "seq"])
def test_tampered_aad_is_rejected(field):
    send, recv = pair()
    seq, ct = send.seal(b"x" * 64, frame_type=FrameType.CHUNK, offset=128)
    kwargs = {"seq": seq, "epoch": 1, "frame_type": FrameType.CHUNK, "offset": 128}
    kwargs[field] = kwargs[field] + 1
    with pytest.raises(TagError):
        recv.open(ct, **kwargs)


def test_message_for_another_session_or_direction_fails_authentication():
    key = channel_key(MASTER, SID, epoch=1, direction=Direction.ORCH_TO_DEVICE)
    seq, ct = SendState(key, session_id=SID).seal(b"cmd", frame_type=FrameType.REQUEST)
    with pytest.raises(TagError):
        RecvState(key, session_id=b"T" * 16).open(ct, seq=seq, epoch=1, frame_type=FrameType.REQUEST)
    other = channel_key(MASTER, SID, epoch=1, direction=Direction.DEVICE_TO_ORCH)
    with pytest.raises(TagError):
        RecvState(other, session_id=SID).open(ct, seq=seq, epoch=1, frame_type=FrameType.REQUEST)


def test_replayed_chunk_is_rejected():
    send, recv = pair()
    seq, ct = send.seal(b"once", frame_type=FrameType.CHUNK)
    recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK)
    with pytest.raises(ReplayError, match="already accepted"):
        recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK)


def test_reordering_inside_the_window_is_accepted_beyond_it_rejected():
    send, recv = pair(window=8)
    sealed = [send.seal(bytes([i]) * 8, frame_type=FrameType.CHUNK) for i in range(20)]
    for seq, ct in [sealed[3], sealed[1], sealed[2], sealed[0]]:
        recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK)
    seq, ct = sealed[19]
    recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK)
    old_seq, old_ct = sealed[5]  # 14 behind the top, window is 8
    with pytest.raises(ReplayError, match="older than the replay window"):
        recv.open(old_ct, seq=old_seq, epoch=1, frame_type=FrameType.CHUNK)


def test_stale_epoch_key_is_rejected_after_rotation():
    old_send, _ = pair(epoch=1)
    _, new_recv = pair(epoch=2)
    seq, ct = old_send.seal(b"late", frame_type=FrameType.CHUNK)
    with pytest.raises(StaleEpochError):
        new_recv.open(ct, seq=seq, epoch=1, frame_type=FrameType.CHUNK)
    # claiming the new epoch does not help: the key differs
    with pytest.raises(TagError):
        new_recv.open(ct, seq=seq, epoch=2, frame_type=FrameType.CHUNK)


def test_nonce_counter_exhaustion_raises_instead_of_reusing():
    send, _ = pair(limit=2)
    send.seal(b"a", frame_type=FrameType.CHUNK)
    send.seal(b"b", frame_type=FrameType.CHUNK)
    with pytest.raises(NonceExhaustedError):
        send.seal(b"c", frame_type=FrameType.CHUNK)
    assert send.counter == 2


def test_keys_differ_per_epoch_window_and_direction_and_fingerprints_hide_them():
    a = provisioning_key(MASTER, SID, epoch=1, offset=0, length=100, direction=3)
    b = provisioning_key(MASTER, SID, epoch=2, offset=0, length=100, direction=3)
    c = provisioning_key(MASTER, SID, epoch=1, offset=0, length=101, direction=3)
    d = channel_key(MASTER, SID, epoch=1, direction=1)
    assert len({a.key, b.key, c.key, d.key}) == 4
    assert a.key.hex() not in repr(a) and a.fingerprint == fingerprint(a.key)
    assert len(a.fingerprint) == 16


def test_replay_window_marks_each_sequence_once():
    window = ReplayWindow(16)
    for seq in (0, 2, 1, 10):
        window.accept(seq)
    assert window.seen(1) and not window.seen(3) and window.highest == 10
    with pytest.raises(ReplayError):
        window.accept(2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=30))
def test_fuzzed_channel_accepts_each_genuine_chunk_once_and_nothing_forged(ops):
    send, recv = pair(window=64)
    sealed = [send.seal(bytes([i % 256]) * 16, frame_type=FrameType.CHUNK) for i in range(41)]
    accepted: set[int] = set()
    for idx, flip, epoch_delta in ops:
        seq, ct = sealed[idx]
        data = bytearray(ct)
        if flip:
            data[flip * 3] ^= flip
        try:
            out = recv.open(bytes(data), seq=seq, epoch=1 + epoch_delta, frame_type=FrameType.CHUNK)
        except (TagError, ReplayError, StaleEpochError):
            continue
        assert not flip and not epoch_delta, "a forged chunk was accepted"
        assert seq not in accepted, "a chunk was accepted twice"
        assert out == bytes([idx % 256]) * 16
        accepted.add(seq)


# --- bounded JSON: a peer's header cannot recurse the decoder to death (issue 24 item 5) -----------
def nested_header_frame(depth: int = 8000, ftype: FrameType = FrameType.HELLO) -> bytes:
    header = b"[" * depth + b"]" * depth
    return PREFIX.pack(b"GT", 1, int(ftype), len(header), 0) + header


def test_a_header_nested_8000_deep_is_a_frame_error_for_every_decoder_not_a_recursion_error() -> None:
    import asyncio
    import json

    raw = nested_header_frame()
    with pytest.raises(RecursionError):  # what every decoder did before: no ValueError, an internal bug
        json.loads(raw[PREFIX.size:])
    with pytest.raises(FrameError, match="header nests deeper than the 32 levels allowed"):
        decode_frame(raw)
    with pytest.raises(FrameError, match="header nests deeper than the 32 levels allowed"):
        FrameDecoder().feed(raw)
    with pytest.raises(FrameError, match="header nests deeper than the 32 levels allowed"):
        read_frame(io.BytesIO(raw))

    async def read_async() -> None:
        from gputravel.core.protocol.frames import read_frame_async

        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        await read_frame_async(reader)

    with pytest.raises(FrameError, match="header nests deeper than the 32 levels allowed"):
        asyncio.run(read_async())


def test_json_depth_is_counted_outside_strings_and_the_limit_is_exact() -> None:
    from gputravel.core.protocol.wirejson import MAX_JSON_DEPTH, json_depth, loads_bounded

    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, {"c": [2]}], "d": "\\"[["}') == 4
    assert loads_bounded(b'{"s": "' + b"[" * 10_000 + b'"}') == {"s": "[" * 10_000}  # brackets in a string
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert json_depth(at_limit) == MAX_JSON_DEPTH and loads_bounded(at_limit) is not None
    with pytest.raises(FrameError, match=f"nests deeper than the {MAX_JSON_DEPTH} levels allowed"):
        loads_bounded(b"[" + at_limit + b"]")
    with pytest.raises(FrameError, match="exceeds the 10-byte limit"):
        loads_bounded(b'{"a": 12345}', max_bytes=10)
    with pytest.raises(FrameError, match="not valid JSON"):
        loads_bounded(b"\xff\xfe")
    with pytest.raises(FrameError, match="not a JSON object"):
        decode_frame(PREFIX.pack(b"GT", 1, int(FrameType.HELLO), 2, 0) + b"[]")


def test_the_agent_ends_with_status_4_on_a_hostile_header_from_its_link(tmp_path: object) -> None:
    """The agent decodes the orchestrator's bytes with the same bounds: a nested header ends it cleanly
    (status 4), with no traceback from its reader thread."""
    import threading
    from pathlib import Path

    from gputravel.agents.holder import Agent, open_dataset

    folder = Path(str(tmp_path)) / "h"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"hello world " * 100)
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    with open(w_out, "wb") as out, open(r_in, "rb") as inp, open(w_in, "wb") as to_agent, \
            open(r_out, "rb") as from_agent:
        agent = Agent("h", open_dataset(folder), out, inp)
        status: list[int] = []
        errors: list[BaseException] = []
        hook = threading.excepthook
        threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment,arg-type]
        try:
            t = threading.Thread(target=lambda: status.append(agent.run()))
            t.start()
            hello = read_frame(from_agent)
            assert hello is not None and hello.type is FrameType.HELLO
            to_agent.write(nested_header_frame(ftype=FrameType.HANDOFF))
            to_agent.flush()
            t.join(timeout=20)
        finally:
            threading.excepthook = hook
        assert status == [4] and errors == []


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.integers(0, 2**32 - 1), st.integers(1, 4),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 255),
       st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8) | st.lists(st.integers(), max_size=4),
                       max_size=6))
def test_the_per_chunk_fast_paths_pack_the_same_bytes_as_the_reference_encodings(
        session: bytes, epoch: int, direction: int, seq: int, offset: int, length: int, frame_type: int,
        header: dict[str, object]) -> None:
    """``pack_aad`` (the data path's AAD, no dataclass built) is ``Aad.pack``, byte for byte; a frame header
    encoded with the shared encoder is ``json.dumps`` with the wire's options, and decodes back to itself."""
    import json

    from gputravel.core.protocol.cipher import Aad, pack_aad
    from gputravel.core.protocol.frames import frame_head

    assert pack_aad(session, epoch, direction, seq, offset, length, frame_type) == Aad(
        session, epoch, direction, seq, offset, length, frame_type).pack()
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    assert frame_head(FrameType.CHUNK, header, 0)[PREFIX.size:] == raw
    assert decode_frame(encode_frame(FrameType.CHUNK, header)).header == header


_CHUNK_INT = st.integers(0, 2**63 - 1) | st.integers(2**63, 10**19 - 1) | st.sampled_from([0, 1, 9, 10])


@settings(max_examples=200, deadline=None)
@given(_CHUNK_INT, st.none() | st.integers(0, 1), _CHUNK_INT, _CHUNK_INT, _CHUNK_INT, st.none() | _CHUNK_INT)
def test_a_chunk_header_in_its_canonical_form_decodes_to_what_json_gives(
        e: int, f: int | None, n: int, o: int, s: int, slot: int | None) -> None:
    """The precompiled parse of a per-chunk header (``frames._CHUNK_HEADER``) gives exactly ``json``'s dict: the
    same keys in the same order and the same ints, for the notification as the agent writes it."""
    import json

    from gputravel.core.protocol.frames import _CHUNK_HEADER, _parse_header

    header: dict[str, int] = {"e": e, "n": n, "o": o, "s": s}
    if f is not None:
        header["f"] = f
    if slot is not None:
        header["slot"] = slot
    raw = frame_head(FrameType.CHUNK, header, 0)[PREFIX.size:]
    assert _CHUNK_HEADER.match(raw) is not None  # the fast path is the one taken
    parsed = _parse_header(raw)
    assert parsed == json.loads(raw) and list(parsed) == list(json.loads(raw))
    assert all(type(v) is int for v in parsed.values())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.binary(min_size=1, max_size=3), st.booleans())
def test_a_mutated_chunk_header_is_decoded_as_json_decodes_it_or_refused(pos: int, junk: bytes, insert: bool) -> None:
    """Bytes near the canonical form (a sign, a leading zero, a float, spaces, a key renamed or repeated,
    trailing bytes): whatever ``_parse_header`` returns is what the JSON decoder returns; what JSON refuses
    is a ``FrameError``."""
    import json

    from gputravel.core.protocol.frames import _parse_header

    raw = b'{"e":3,"f":0,"n":1048576,"o":5242880,"s":5,"slot":5}'
    pos = min(pos, len(raw))
    mutated = raw[:pos] + junk + raw[pos + (0 if insert else len(junk)):]
    try:
        expected = json.loads(mutated)
    except (ValueError, UnicodeDecodeError):
        with pytest.raises(FrameError):
            _parse_header(mutated)
        return
    if not isinstance(expected, dict):
        with pytest.raises(FrameError):
            _parse_header(mutated)
        return
    got = _parse_header(mutated)
    assert got == expected and [type(v) for v in got.values()] == [type(v) for v in expected.values()]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8), st.booleans(), st.integers(0, 2**64 - 1),
       st.integers(0, 2**64 - 1))
def test_a_batched_ack_is_the_same_frame_as_the_json_encoder_writes(batch: list[int], with_slots: bool, epoch: int,
                                                                   contiguous: int) -> None:
    """``encode_ack_batch`` (the device's batched ACK, built without the JSON encoder) is byte for byte
    ``encode_frame(ACK, ...)``: the wire format is unchanged, so no version changes."""
    from gputravel.core.protocol.frames import encode_ack_batch

    slots = [s % 256 for s in batch] if with_slots else None
    header: dict[str, object] = {"batch": batch, "e": epoch, "contiguous": contiguous}
    if slots is not None:
        header["slots"] = slots
    assert encode_ack_batch(batch, slots, epoch, contiguous) == encode_frame(FrameType.ACK, header)
    assert decode_frame(encode_ack_batch(batch, slots, epoch, contiguous)).header == header
