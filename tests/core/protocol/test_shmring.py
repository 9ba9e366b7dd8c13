"""The shared-memory ring of bounce slots (``core/protocol/shmring.py``) on its own: real memfds, real
``SCM_RIGHTS`` over a real Unix socket pair, real mappings in two places. The ring through the device
service (garbage, replays, stale epochs, out-of-window offsets written into it) is in
``test_device_service.py``."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import tempfile

import pytest

from gputravel.core.protocol import TAG_LEN, FrameType, encode_frame
from gputravel.core.protocol.errors import FrameError, StaleEpochError
from gputravel.core.protocol.shmring import (
    MAX_RING_BYTES,
    MAX_SLOTS,
    RingReceiver,
    RingSpec,
    ShmRing,
    recv_frame_with_fds,
    ring_supported,
    send_frame_with_fd,
)

pytestmark = pytest.mark.skipif(not ring_supported(), reason="needs Linux memfd_create with sealing")

SPEC = RingSpec(epoch=3, slots=4, slot_bytes=1024 + TAG_LEN)


def test_a_ring_is_anonymous_0600_zero_filled_and_sealed_against_resizing() -> None:
    with ShmRing.create(SPEC) as ring:
        fd = ring.fileno()
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == SPEC.nbytes
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert link.startswith("/memfd:gputravel-ring") and "(deleted)" in link  # no name anyone could open
        assert not any(n.startswith("gputravel-ring") for n in os.listdir("/dev/shm"))
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 16)  # cutting the mapping from under the reader is impossible
        assert all(not any(ring.slot(k)) for k in range(SPEC.slots))


def test_the_descriptor_crosses_a_unix_socket_and_both_mappings_share_the_slots() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right, ShmRing.create(SPEC) as device:
        frame = encode_frame(FrameType.DATA_READY, {"ring": SPEC.to_wire()})
        send_frame_with_fd(left, frame + encode_frame(FrameType.ACK, {"s": 1}), device.fileno())
        got = recv_frame_with_fds(right)
        assert got is not None
        ready, fds = got
        assert ready.type is FrameType.DATA_READY and len(fds) == 1
        follow = recv_frame_with_fds(right)  # the next frame is intact: nothing was read ahead
        assert follow is not None and follow[0].type is FrameType.ACK and follow[1] == []
        with ShmRing.attach(fds[0], RingSpec.from_wire(ready.header["ring"])) as agent:
            agent.slot(2)[:5] = b"hello"
            assert bytes(device.slot(2)[:5]) == b"hello"
            device.release()  # RETURN: zeroed for both
            assert not any(agent.slot(2))


@pytest.mark.parametrize("problem", ["short", "unsealed", "group-readable", "regular-file"])
def test_attach_refuses_a_descriptor_that_is_not_a_sealed_private_ring_and_closes_it(problem: str) -> None:
    if problem == "regular-file":
        f = tempfile.TemporaryFile()  # noqa: SIM115 - closed through the descriptor
        os.ftruncate(f.fileno(), SPEC.nbytes)
        fd = os.dup(f.fileno())
        f.close()
    else:
        fd = os.memfd_create("not-a-ring", os.MFD_ALLOW_SEALING)
        os.fchmod(fd, 0o640 if problem == "group-readable" else 0o600)
        os.ftruncate(fd, SPEC.nbytes // 2 if problem == "short" else SPEC.nbytes)
        if problem != "unsealed":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    with pytest.raises(FrameError):
        ShmRing.attach(fd, SPEC)
    with pytest.raises(OSError):
        os.fstat(fd)  # the refused descriptor was closed, not leaked


@pytest.mark.parametrize("wire", [None, [], {"epoch": 1, "slots": 0, "slot_bytes": 64},
                                  {"epoch": 1, "slots": MAX_SLOTS + 1, "slot_bytes": 64},
                                  {"epoch": 1, "slots": 2, "slot_bytes": TAG_LEN},
                                  {"epoch": 1, "slots": 2, "slot_bytes": MAX_RING_BYTES},
                                  {"epoch": True, "slots": 2, "slot_bytes": 64},
                                  {"epoch": 1, "slots": "2", "slot_bytes": 64},
                                  {"epoch": -1, "slots": 2, "slot_bytes": 64}])
def test_a_malformed_ring_spec_is_a_frame_error(wire: object) -> None:
    with pytest.raises(FrameError):
        RingSpec.from_wire(wire)


@pytest.mark.parametrize("slot", [-1, 4, "1", True, None, 1.0])
def test_a_notification_naming_no_slot_of_the_ring_is_a_frame_error(slot: object) -> None:
    with ShmRing.create(SPEC) as ring:
        with pytest.raises(FrameError):
            RingReceiver(ring).take({"e": 3, "s": 0, "o": 0, "n": 16, "slot": slot})


@pytest.mark.parametrize("n", [0, -5, 1024 + 1, "16", None])
def test_a_chunk_length_that_does_not_fit_its_slot_is_a_frame_error(n: object) -> None:
    with ShmRing.create(SPEC) as ring:
        with pytest.raises(FrameError):
            RingReceiver(ring).take({"e": 3, "s": 0, "o": 0, "n": n, "slot": 1})


def test_take_gives_the_chunk_header_and_its_sealed_bytes_in_place() -> None:
    with ShmRing.create(SPEC) as ring:
        ring.slot(1)[: 100 + TAG_LEN] = bytes(range(100 + TAG_LEN))
        header, view = RingReceiver(ring).take({"e": 3, "s": 7, "o": 700, "n": 100, "slot": 1})
        assert header == {"e": 3, "s": 7, "o": 700, "n": 100}
        assert bytes(view) == bytes(range(100 + TAG_LEN))
        del view


def test_a_released_ring_is_refused_as_stale_until_bound_again_and_a_closed_one_for_good() -> None:
    ring = ShmRing.create(SPEC)
    receiver = RingReceiver(ring)
    ring.slot(0)[:4] = b"\xff\xff\xff\xff"
    ring.release()
    assert not any(ring.slot(0))
    with pytest.raises(StaleEpochError):
        receiver.take({"e": 3, "s": 0, "o": 0, "n": 16, "slot": 0})
    ring.bind(4)
    assert ring.spec.epoch == 4
    assert receiver.take({"e": 4, "s": 0, "o": 0, "n": 16, "slot": 0})[0]["e"] == 4
    ring.close()
    with pytest.raises(StaleEpochError):
        receiver.take({"e": 4, "s": 0, "o": 0, "n": 16, "slot": 0})
    with pytest.raises(StaleEpochError):
        ring.slot(0)
