"""A relayed HANDOFF's window request answered at the window's completion (``Op.HANDOFF``'s ``when_complete``, task
complete14), against a real device service and server in this process over real Unix sockets: the answer is the
grant with the closed window once the last chunk is in device memory, and only then; an incomplete window is left
open at the bound (its status answered) and takes its remaining chunks; a holder's data connection that goes ends the
wait at once (the control link is free for the next call); a HANDOFF not relayed is answered at once; bad bounds are
refused before anything changes."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import ConnectedDevice

from gputravel.core.deviceclient.onloop import Completion
from gputravel.core.errors import DeviceError
from gputravel.core.protocol import TAG_LEN, Direction, FrameType, SendState, encode_frame, provisioning_key
from gputravel.core.protocol.deviceanswers import WindowClosed, WindowStatus
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.protocol.keys import DirectionKey
from gputravel.core.protocol.shmring import recv_frame_with_fds

CHUNK = 256
N = 4  # chunks a window


class Device(ConnectedDevice):
    """A real device service and server in this process, and the orchestrator's control client."""

    def __init__(self, connected: ConnectedDevice) -> None:
        super().__init__(connected.service, connected.server, connected.sock, connected.client)
        self.epoch = 0


@pytest.fixture
def device(connected_device: ConnectedDevice) -> Device:
    return Device(connected_device)


class Conn:
    """A holder's data connection, as its agent holds it: admitted for a window, then parked at the device."""

    def __init__(self, dev: Device, key: DirectionKey, session: bytes, epoch: int, holder: str = "alice") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(dev.sock)
        self.session, self.holder = session, holder
        assert self.send(FrameType.DATA_OPEN, self._admit(key, epoch)).type is FrameType.DATA_READY

    def _admit(self, key: DirectionKey, epoch: int) -> dict[str, Any]:
        admit = Admission.make(key.key, session_id=self.session, epoch=epoch, holder=self.holder)
        return {"session": self.session.hex(), "admit": admit.to_wire()}

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> Any:
        self.sock.sendall(encode_frame(ftype, header, payload))
        got = recv_frame_with_fds(self.sock)
        return None if got is None else got[0]

    def take_relayed(self, key: DirectionKey, epoch: int) -> None:
        """The relayed HANDOFF read on the parked connection, and the connection admitted for its window."""
        got = recv_frame_with_fds(self.sock)
        assert got is not None and got[0].type is FrameType.HANDOFF and got[0].header["epoch"] == epoch
        assert self.send(FrameType.DATA_OPEN, self._admit(key, epoch)).type is FrameType.DATA_READY

    def chunk(self, key: DirectionKey, seq: int) -> Any:
        out = bytearray(CHUNK + TAG_LEN)
        SendState(key, session_id=self.session, start=seq).seal_into(os.urandom(CHUNK), out, frame_type=FrameType.CHUNK,
                                                                      offset=seq * CHUNK, length=CHUNK)
        return self.send(FrameType.CHUNK, {"e": key.epoch, "s": seq, "o": seq * CHUNK, "n": CHUNK}, bytes(out))

    def close(self) -> None:
        self.sock.close()


class Counting(threading.Condition):
    """The windows' ``completed`` condition, counting its notifications."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def parked(dev: Device, holder: str = "alice") -> Conn:
    """A connection admitted for a window of its own, which returns: parked at the device, bound to ``holder``."""
    dev.epoch += 1
    grant = dev.client.handoff(epoch=dev.epoch, offset=0, length=N * CHUNK, chunk_size=CHUNK)
    conn = Conn(dev, grant.provisioning_key, bytes.fromhex(grant.session_id), dev.epoch, holder)
    dev.client.close_window(epoch=dev.epoch)
    return conn


def next_window(dev: Device) -> tuple[int, DirectionKey, dict[str, Any]]:
    """The next window's epoch, the key the device will derive for it, and its HANDOFF wrapped for the holder (as
    the orchestrator builds it before the window opens)."""
    secrets = dev.client.secrets
    assert secrets is not None
    dev.epoch += 1
    key = provisioning_key(secrets.master, secrets.session_id, epoch=dev.epoch, offset=0, length=N * CHUNK,
                           direction=Direction.HOLDER_TO_DEVICE)
    head = {"epoch": dev.epoch, "session": secrets.session_id.hex(), "wrapped_key": "ab" * 40,
            "key_fp": key.fingerprint, "relay": os.urandom(8).hex()}
    return dev.epoch, key, head


def ask_while(dev: Device, holder: str, head: dict[str, Any], within: Any, then: Callable[[], None]
              ) -> tuple[Completion, float]:
    """The window's request held for completion, ``then()`` run in a thread meanwhile (the holder's side); the answer
    and the seconds it took."""
    async def go() -> tuple[Completion, float]:
        t0 = time.perf_counter()
        answer = asyncio.ensure_future(dev.client.on_loop.handoff_until_complete(
            epoch=head["epoch"], offset=0, length=N * CHUNK, chunk_size=CHUNK, relay=(holder, head), within=within))
        holder_side = threading.Thread(target=then)
        holder_side.start()
        got = await asyncio.wait_for(answer, 20)
        took = time.perf_counter() - t0
        await asyncio.to_thread(holder_side.join, 20)
        return got, took
    return asyncio.run(go())


def test_the_answer_comes_once_the_window_is_complete_with_the_window_closed(device: Device) -> None:
    conn = parked(device)
    epoch, key, head = next_window(device)
    acks: list[Any] = []
    windows = device.service.windows
    windows.completed = completed = Counting(windows.lock)

    def holder() -> None:
        conn.take_relayed(key, epoch)
        time.sleep(0.2)  # the answer waits for the chunks: it is not back before them
        acks.extend(conn.chunk(key, seq) for seq in range(N))

    (grant, end), took = ask_while(device, "alice", head, 4.0, holder)
    assert grant.relayed and grant.key_fingerprint == key.fingerprint
    assert [a.type for a in acks] == [FrameType.ACK] * N
    assert isinstance(end, WindowClosed) and end.epoch == epoch and end.complete and end.bytes == N * CHUNK
    assert "answered" in end.marks_ns and end.marks_ns["answered"] >= end.marks_ns["last_chunk"]
    assert took >= 0.2 and device.service.windows.window is None  # closed in the answer: its key is dead
    assert completed.notified == 1  # the held request was woken once, at completion, not per chunk
    late = conn.chunk(key, 0)  # a chunk after the answer is refused, never written
    assert late.type is FrameType.ERROR and late.header["code"] in ("replay", "stale-epoch")
    assert device.service.plane.admissions.connections(epoch) == 0  # the window's connections released after it
    conn.close()


def test_an_incomplete_window_at_the_bound_answers_its_status_and_takes_the_rest(device: Device) -> None:
    conn = parked(device)
    epoch, key, head = next_window(device)

    def holder() -> None:
        conn.take_relayed(key, epoch)
        assert conn.chunk(key, 0).type is FrameType.ACK

    (grant, end), took = ask_while(device, "alice", head, 0.4, holder)
    assert grant.relayed and isinstance(end, WindowStatus)
    assert end.open and end.epoch == epoch and end.chunks == 1 and took >= 0.4
    assert all(conn.chunk(key, seq).type is FrameType.ACK for seq in range(1, N))  # still open: the rest arrives
    closed = device.client.close_window(epoch=epoch)  # RETURN closes it, as without the option
    assert closed.complete and closed.chunks == N and "answered" not in closed.marks_ns
    conn.close()


def test_a_data_connection_that_goes_ends_the_wait_and_frees_the_control_link(device: Device) -> None:
    conn = parked(device)
    epoch, key, head = next_window(device)

    def holder() -> None:
        conn.take_relayed(key, epoch)
        assert conn.chunk(key, 0).type is FrameType.ACK
        conn.close()  # the agent failed

    (grant, end), took = ask_while(device, "alice", head, 4.0, holder)
    assert grant.relayed and isinstance(end, WindowStatus) and end.open and end.chunks == 1
    assert took < 3.0  # well before its bound
    t0 = time.perf_counter()
    closed = device.client.close_window(epoch=epoch)  # the control link answers at once, in step
    assert time.perf_counter() - t0 < 2.0 and closed.epoch == epoch and not closed.complete


def test_a_handoff_not_relayed_is_answered_at_once_with_the_grant_alone(device: Device) -> None:
    conn = parked(device)
    epoch, key, head = next_window(device)
    (grant, end), took = ask_while(device, "carol", head, 4.0, lambda: None)  # nothing parked for carol
    assert not grant.relayed and end is None and took < 3.0
    assert device.service.windows.window is not None and device.service.windows.window.epoch == epoch
    device.client.close_window(epoch=epoch)
    conn.close()


@pytest.mark.parametrize("within", [0, -1, 5.5, "soon", True])
def test_a_bound_outside_its_limits_is_refused_before_anything_changes(device: Device, within: Any) -> None:
    conn = parked(device)
    epoch, _key, head = next_window(device)
    with pytest.raises(DeviceError, match="when_complete"):
        ask_while(device, "alice", head, within, lambda: None)
    assert device.service.windows.window is None and device.service.windows.epoch == epoch - 1
    with pytest.raises(DeviceError, match="when_complete"):  # and never without a relay
        device.client.call("handoff", epoch=epoch, offset=0, length=N * CHUNK, chunk_size=CHUNK, when_complete=1.0)
    assert device.service.windows.window is None
    conn.close()
