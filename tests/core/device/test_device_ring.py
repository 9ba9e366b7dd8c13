"""The shared-memory ring (the direct path's same-host mode) through the real device service process: chunks
sealed into ring slots, and hostile ones (garbage, replays, stale epochs, out-of-window offsets) refused by
name and counted exactly as the same bytes sent on the socket path. Its own device service (module scope),
built as ``test_device_service.py`` builds one."""

from __future__ import annotations

import random
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import device_process
from test_device_service import (
    BUFFER,
    DataConn,
    Rig,
    Window,
    _program,
    flip,
    plaintext,
    sha,
)

from gputravel.core.protocol import TAG_LEN, Frame, FrameType, encode_frame
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.protocol.shmring import RingSpec, ShmRing, recv_frame_with_fds, ring_supported

pytestmark = pytest.mark.skipif(not ring_supported(), reason="needs Linux memfd_create with sealing")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """This module's own device service (fault injection on, for the digest op)."""
    with device_process(tmp_path_factory.mktemp("ring-device"), buffer_bytes=BUFFER,
                        allow_fault_injection=True) as dev:
        rig = Rig(dev.handle, dev.client)
        rig.call("configure", _program())
        yield rig


@pytest.fixture(autouse=True)
def _no_window_left_open(rig: Rig) -> Iterator[None]:
    yield
    if rig.alive():
        rig.close_any()


# --- the shared-memory ring (same-host direct path) ------------------------------------------------
class RingConn:
    """A data connection that asked for rings, with the device's ring for one hand-off mapped here too:
    the holder writes sealed chunks into slots and sends only ``CHUNK {e, s, o, n, slot}``."""

    def __init__(self, rig: Rig, w: Window, *, slots: int = 4) -> None:
        self.rig = rig
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(rig.handle.socket_path)
        self.session = rig.client.session_id.hex()
        admit = Admission.make(w.key.key, session_id=w.session_id, epoch=w.epoch, holder="holder").to_wire()
        self.sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": self.session, "rings": 1, "admit": admit}))
        ready = recv_frame_with_fds(self.sock)
        assert ready is not None and ready[0].type is FrameType.DATA_READY and ready[0].header.get("rings") == 1
        self.ring: ShmRing | None = None
        self.bind(w, slots=slots)

    def request(self, spec: RingSpec, w: Window | None = None) -> tuple[Frame, list[int]]:
        """Ask for a ring (``w``: admitted for that window in the same frame, as for a holder's next window)."""
        head = {"session": self.session, "ring": spec.to_wire()}
        if w is not None:
            head["admit"] = Admission.make(w.key.key, session_id=w.session_id, epoch=w.epoch,
                                           holder="holder").to_wire()
        self.sock.sendall(encode_frame(FrameType.DATA_OPEN, head))
        got = recv_frame_with_fds(self.sock)
        assert got is not None
        return got

    def bind(self, w: Window, *, slots: int = 4) -> Frame:
        """Ask for the ring of ``w``'s epoch; map it if the device sent a descriptor."""
        spec = RingSpec(w.epoch, slots, w.chunk_size + TAG_LEN)
        frame, fds = self.request(spec, w)
        assert frame.type is FrameType.DATA_READY, frame
        if fds:
            if self.ring is not None:
                self.ring.close(zero=False)
            self.ring = ShmRing.attach(fds[0], spec)
        return frame

    def read(self) -> Frame:
        got = recv_frame_with_fds(self.sock)
        assert got is not None, "the service closed the data connection"
        return got[0]

    def put(self, slot: int, header: dict[str, Any], payload: bytes) -> Frame:
        assert self.ring is not None
        self.ring.slot(slot)[: len(payload)] = payload
        self.sock.sendall(encode_frame(FrameType.CHUNK, {**header, "slot": slot}))
        return self.read()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close(zero=False)
        self.sock.close()

    def __enter__(self) -> RingConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_chunks_sealed_into_ring_slots_are_acknowledged_with_their_slot_and_land_as_plaintext(rig: Rig) -> None:
    before = rig.rejected()
    w = rig.handoff(offset=8192, length=1000, chunk_size=256)
    data = plaintext(w.length, seed=21)
    with RingConn(rig, w) as conn:
        for seq in range(w.n_chunks):
            ack = conn.put(seq % 4, *w.seal(seq, data))
            assert ack.type is FrameType.ACK, ack
            assert (ack.header["s"], ack.header["slot"], ack.header["contiguous"]) == (seq, seq % 4, seq + 1)
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert report["complete"] is True and report["bytes"] == 1000
    assert rig.rejected() == before


def test_an_agent_that_marks_its_chunks_is_acknowledged_in_batches_and_fully_before_it_waits(rig: Rig) -> None:
    """Chunks marked ``f`` (the holder agent does) may be acknowledged in batches of half the ring; a chunk
    marked ``f: 1`` (the agent is about to wait) flushes every acknowledgement held back, and a refusal
    goes out at once, after them."""
    before = rig.rejected()
    w = rig.handoff(offset=8192, length=256 * 7, chunk_size=256)
    data = plaintext(w.length, seed=33)

    def notify(seq: int, slot: int, *, flush: int, tamper: bool = False) -> None:
        _notify(conn, w, data, seq, slot, flush=flush, tamper=tamper)

    with RingConn(rig, w, slots=4) as conn:  # 4 slots: batches of 2
        for seq in range(4):  # the agent fills its ring, marking the last chunk before it waits
            notify(seq, seq, flush=int(seq == 3))
        acks = [conn.read(), conn.read()]
        assert [a.type for a in acks] == [FrameType.ACK, FrameType.ACK]
        assert [(a.header["batch"], a.header["slots"]) for a in acks] == [([0, 1], [0, 1]), ([2, 3], [2, 3])]
        assert acks[-1].header["contiguous"] == 4
        notify(4, 0, flush=1)  # one chunk, then the agent waits: acknowledged alone, at once
        ack = conn.read()
        assert (ack.type, ack.header["batch"], ack.header["slots"]) == (FrameType.ACK, [4], [0])
        notify(5, 1, flush=0)  # held back (one of two) ...
        notify(6, 2, flush=1, tamper=True)  # ... until this one is refused: the held acknowledgement first
        ack, err = conn.read(), conn.read()
        assert (ack.type, ack.header["batch"]) == (FrameType.ACK, [5])
        assert (err.type, err.header["s"], err.header["slot"], err.header["code"]) == (FrameType.ERROR, 6, 2, "tag")
        notify(6, 2, flush=1)  # resent from its slot, as the agent does
        ack = conn.read()
        assert (ack.type, ack.header["batch"], ack.header["contiguous"]) == (FrameType.ACK, [6], 7)
    assert rig.digest(w.offset, w.length) == sha(data)
    report = rig.close(w)
    assert report["complete"] is True and report["bytes"] == w.length
    assert rig.rejected() - before == Counter({"tag": 1})


def test_batched_acknowledgements_start_afresh_with_the_next_hand_off_on_the_same_connection(rig: Rig) -> None:
    """A holder's data connection outlives its hand-offs (admitted again for each window): the next window's
    batches count its own chunks."""
    first = rig.handoff(offset=0, length=256 * 4, chunk_size=256)
    data = plaintext(first.length, seed=34)
    with RingConn(rig, first, slots=4) as conn:
        for seq in range(4):
            _notify(conn, first, data, seq, seq, flush=int(seq == 3))
        assert [conn.read().header["contiguous"] for _ in range(2)] == [2, 4]
        rig.close(first)
        second = rig.handoff(offset=0, length=256 * 2, chunk_size=256)
        conn.bind(second, slots=4)
        _notify(conn, second, data[:512], 0, 0, flush=1)
        ack = conn.read()
        assert (ack.header["batch"], ack.header["e"], ack.header["contiguous"]) == ([0], second.epoch, 1)
        rig.close(second)


def _notify(conn: RingConn, w: Window, data: bytes, seq: int, slot: int, *, flush: int,
            tamper: bool = False) -> None:
    """Seal chunk ``seq`` of ``w`` into ``slot`` as the holder agent does (``f`` marked), and notify it."""
    assert conn.ring is not None
    head, ct = w.seal(seq, data)
    conn.ring.slot(slot)[: len(ct)] = flip(ct, 3) if tamper else ct
    conn.sock.sendall(encode_frame(FrameType.CHUNK, {**head, "slot": slot, "f": flush}))


def _attack(kind: str, w: Window, data: bytes, rig: Rig) -> list[tuple[dict[str, Any], bytes]]:
    """The frames of one attack on window ``w``: a genuine chunk first where the attack needs one."""
    head, ct = w.seal(0, data)
    if kind == "garbage":
        return [(head, flip(ct, 7))]
    if kind == "random":
        return [(head, random.Random(5).randbytes(len(ct)))]
    if kind == "replay":
        return [(head, ct), (head, ct)]
    if kind == "stale-epoch":
        return [({**head, "e": w.epoch - 1}, ct)]
    if kind == "out-of-window":
        off = w.offset + w.length
        return [({**head, "o": off, "s": w.n_chunks}, ct)]
    raise AssertionError(kind)


@pytest.mark.parametrize(("kind", "code"), [("garbage", "tag"), ("random", "tag"), ("replay", "replay"),
                                            ("stale-epoch", "stale-epoch"), ("out-of-window", "window")])
def test_hostile_chunks_written_into_the_ring_are_refused_and_counted_exactly_as_on_the_socket(
        rig: Rig, kind: str, code: str) -> None:
    answers: dict[str, list[str]] = {}
    counted: dict[str, Counter[str]] = {}
    for path in ("socket", "ring"):
        rig.call("scrub")  # earlier tests left bytes in the buffer
        w = rig.handoff(offset=0, length=512, chunk_size=256)
        data = plaintext(w.length, seed=30)
        before = rig.rejected()
        frames = _attack(kind, w, data, rig)
        got: list[Frame] = []
        if path == "socket":
            with DataConn(rig) as conn:
                got = [conn.send(FrameType.CHUNK, h, p) for h, p in frames]
        else:
            with RingConn(rig, w) as ring_conn:
                got = [ring_conn.put(0, h, p) for h, p in frames]
        answers[path] = [f.header.get("code", "ack") if f.type is FrameType.ERROR else "ack" for f in got]
        counted[path] = rig.rejected() - before
        assert rig.digest(0, 512) == (sha(data[:256] + bytes(256)) if kind == "replay" else sha(bytes(512)))
        rig.close(w)
    assert answers["ring"] == answers["socket"] and answers["ring"][-1] == code
    assert counted["ring"] == counted["socket"] == Counter({code: 1})


def test_return_zeroes_the_ring_and_a_later_notification_is_refused_as_stale_and_charged_to_nobody(
        rig: Rig) -> None:
    w = rig.handoff(offset=0, length=512, chunk_size=256)
    data = plaintext(w.length, seed=31)
    with RingConn(rig, w) as conn:
        assert conn.put(1, *w.seal(0, data)).type is FrameType.ACK
        assert conn.ring is not None and any(conn.ring.slot(1))
        rig.close(w)  # RETURN
        assert not any(conn.ring.slot(1)) and not any(conn.ring.slot(0))  # zeroed for the holder too
        before = rig.rejected()
        answer = conn.put(1, *w.seal(1, data))
        assert answer.type is FrameType.ERROR and answer.header["code"] == "stale-epoch", answer
        assert answer.header["slot"] == 1 and rig.rejected() - before == Counter({"stale-epoch": 1})
        by_epoch = rig.client.stats(since=0).rejected_by_epoch
        assert str(w.epoch) not in by_epoch  # admitted for no window after RETURN: anonymous


def test_the_next_hand_off_binds_the_same_ring_and_no_descriptor_travels_again(rig: Rig) -> None:
    first = rig.handoff(offset=0, length=512, chunk_size=256)
    made = rig.client.stats().counters.get("rings_made", 0)
    with RingConn(rig, first) as conn:
        rig.close(first)
        second = rig.handoff(offset=0, length=512, chunk_size=256)
        again = conn.bind(second)  # admitted for the new window in the same frame
        assert again.header.get("mapped") == 1  # the ring this connection maps, bound to the new epoch
        data = plaintext(second.length, seed=32)
        assert conn.put(0, *second.seal(0, data)).type is FrameType.ACK
        counters = rig.client.stats().counters
        assert counters["rings_made"] == made + 1 and counters["rings_bound"] >= 2
        rig.close(second)


def test_a_first_data_open_with_a_ring_gets_it_in_the_admission_answer(rig: Rig) -> None:
    """One round trip: the ring asked for with the admission comes back with DATA_READY (its descriptor)."""
    w = rig.handoff(offset=0, length=512, chunk_size=256)
    spec = RingSpec(w.epoch, 4, 256 + TAG_LEN)
    admit = Admission.make(w.key.key, session_id=w.session_id, epoch=w.epoch, holder="holder").to_wire()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(rig.handle.socket_path)
        sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": rig.client.session_id.hex(), "rings": 1,
                                                        "ring": spec.to_wire(), "admit": admit}))
        got = recv_frame_with_fds(sock)
        assert got is not None and got[0].type is FrameType.DATA_READY and len(got[1]) == 1
        assert RingSpec.from_wire(got[0].header["ring"]) == spec
        ring = ShmRing.attach(got[1][0], spec)
        data = plaintext(w.length, seed=32)
        head, ct = w.seal(0, data)
        ring.slot(2)[: len(ct)] = ct
        sock.sendall(encode_frame(FrameType.CHUNK, {**head, "slot": 2}))
        ack = recv_frame_with_fds(sock)
        assert ack is not None and ack[0].type is FrameType.ACK and ack[0].header["slot"] == 2
        ring.close(zero=False)
    rig.close(w)


def test_a_ring_for_an_epoch_without_an_open_window_is_refused_by_name_and_counted(rig: Rig) -> None:
    w = rig.handoff(offset=0, length=512, chunk_size=256)
    with RingConn(rig, w) as conn:
        before = rig.rejected()
        for spec, code in ((RingSpec(w.epoch + 5, 4, 256 + TAG_LEN), "stale-epoch"),
                           (RingSpec(w.epoch, 4, 999), "frame")):
            frame, fds = conn.request(spec)
            assert fds == [] and frame.type is FrameType.ERROR, frame
            assert frame.header["code"] == code and frame.header["ring"] == 1
        assert rig.rejected() - before == Counter({"stale-epoch": 1, "frame": 1})
        rig.close(w)


def test_rings_are_never_offered_on_the_tcp_data_port(rig: Rig) -> None:
    assert rig.handle.data_port is not None
    w = rig.handoff(offset=0, length=512, chunk_size=256)
    admit = Admission.make(w.key.key, session_id=w.session_id, epoch=w.epoch, holder="holder").to_wire()
    with socket.create_connection((rig.handle.data_host, rig.handle.data_port), timeout=10) as sock:
        sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": rig.client.session_id.hex(), "rings": 1,
                                                        "admit": admit}))
        ready = recv_frame_with_fds(sock)
        assert ready is not None and ready[0].type is FrameType.DATA_READY and "rings" not in ready[0].header
        sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": rig.client.session_id.hex(),
                                                        "ring": RingSpec(w.epoch, 4, 256 + TAG_LEN).to_wire()}))
        refused = recv_frame_with_fds(sock)
        assert refused is not None and refused[1] == [] and refused[0].header["code"] == "frame"
    rig.close(w)
