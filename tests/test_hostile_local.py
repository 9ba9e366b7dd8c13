"""Another local user against the device's listeners, written as the attacker's script.

The attacker holds no key and no session: it can only open connections to whatever the device listens on
and stall, trickle or flood them. It must not be able to stop a visit (issue 24, row 1):

- a same-host run listens on no TCP port at all (its holders reach the private Unix socket);
- the TCP data port's strangers have a budget of their own and never take the Unix socket's places;
- an unauthenticated connection has one deadline for the whole hand-shake, not one per read, so a peer
  that trickles a byte at a time is cut off at that deadline all the same.

Where the tests run as root the attacker's connections come from another uid (``nobody``), as a local
user's would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputravel.core.api import tcp_data_host
from gputravel.core.config import RunSettings

NOBODY = 65534


def _wait_for(what: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(what())


@pytest.fixture
def device(tmp_path: Path) -> Iterator[tuple[Any, Any, str, Any]]:
    """A real device service (real sockets, real keys) in this process, listening on its Unix socket and on a
    TCP data port, with small bounds: 4 connections may wait to authenticate per listener, for ``deadline``."""
    from gputravel.core.device.server import DeviceServer
    from gputravel.core.device.service import load_service
    from gputravel.core.deviceclient.client import DeviceClient
    from gputravel.core.platform.emulated import EmulatedPlatform

    state = tmp_path / "state"
    service = load_service(state, buffer_bytes=1 << 16)
    sock = str(tmp_path / "d.sock")
    server = DeviceServer(service, sock, data_host="127.0.0.1", max_pending=4, handshake_timeout=0.6)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    assert _wait_for(lambda: os.path.exists(sock) and server.tcp is not None, 30)
    anchors = EmulatedPlatform(state).anchors()
    try:
        yield service, server, sock, lambda: DeviceClient(sock, anchors=anchors)
    finally:
        server.close()
        thread.join(5)


ATTACKER = r"""
import encodings.idna, os, socket, sys, time  # idna before the uid changes: nobody cannot read this Python
port, n, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # another local user
conns = []
for _ in range(n):
    try:
        conns.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(os.getuid(), len(conns), flush=True)
time.sleep(hold)
"""


def test_a_same_host_run_listens_on_no_tcp_port() -> None:
    """Only holders on other hosts (an inventory on the direct path) need the TCP data port."""
    assert tcp_data_host(RunSettings(transport="local")) == ""
    assert tcp_data_host(RunSettings(transport="ssh")) == ""
    assert tcp_data_host(RunSettings(transport="inventory", data_path="channel")) == ""
    assert tcp_data_host(RunSettings(transport="inventory", data_host="127.0.0.1")) == "127.0.0.1"


def test_strangers_on_the_tcp_port_never_take_the_unix_sockets_places(
        device: tuple[Any, Any, str, Any]) -> None:
    """40 idle connections from another local user overflow the data port's budget (4): each newcomer takes
    the oldest one's place (``evicted``); the orchestrator's control session on the Unix socket opens all
    the same, while they still stall."""
    service, server, _sock, new_client = device
    port = server.tcp.getsockname()[1]
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "40", "20"], stdout=subprocess.PIPE,
                                text=True)
    try:
        line = (attacker.stdout.readline() if attacker.stdout else "").split()
        assert len(line) == 2 and int(line[1]) >= 4
        if os.getuid() == 0:
            assert int(line[0]) == NOBODY
        assert _wait_for(lambda: service.refused["evicted"] >= 36)
        assert len(server._pending_tcp) <= 4 and len(server._pending_unix) == 0
        client = new_client()
        try:
            assert client.connect().ok  # the device still serves its genuine peer on the Unix socket
        finally:
            client.close()
        assert attacker.poll() is None  # ... while the attacker's connections are still held open
    finally:
        attacker.kill()
        attacker.wait(10)


def test_a_trickling_peer_is_cut_off_at_the_handshake_deadline_not_kept_alive_by_each_byte(
        device: tuple[Any, Any, str, Any]) -> None:
    """One byte every 0.1 s keeps a per-read timeout (0.6 s) from ever firing; the deadline is for the whole
    hand-shake, so the device shuts the connection and counts it as ``timeout``."""
    service, server, _sock, _new_client = device
    port = server.tcp.getsockname()[1]
    cut_off = False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        header = b"\x00\x00\x10\x00"  # a frame announcing 4 KiB, sent one byte at a time
        for i in range(100):  # 10 s of trickling, far past the 0.6 s deadline
            try:
                s.sendall(header[i % len(header):i % len(header) + 1] or b"\x00")
            except OSError:
                cut_off = True
                break
            time.sleep(0.1)
    assert cut_off, "the device kept a trickling, unauthenticated connection open past its deadline"
    assert _wait_for(lambda: service.refused["timeout"] >= 1)
    assert service.refused["timeout"] == 1


def test_strangers_filling_the_tcp_ports_places_cannot_keep_an_admitted_holder_out(
        device: tuple[Any, Any, str, Any]) -> None:
    """Another local user holds more connections open on the TCP data port than it has places (40 > 4); a
    holder's data connection, which is admitted in its first round trip, still gets in and its chunk lands,
    and nothing the strangers did is charged to the holder's window."""
    from gputravel.core.protocol import TAG_LEN, FrameType, SendState, encode_frame, read_frame
    from gputravel.core.protocol.holderlink import Admission

    service, server, _sock, new_client = device
    port = server.tcp.getsockname()[1]
    client = new_client()
    client.connect()
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "40", "20"], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline()
        assert _wait_for(lambda: service.refused["evicted"] >= 30), dict(service.refused)
        grant = client.handoff(epoch=1, offset=0, length=256, chunk_size=256)
        key, session = grant.provisioning_key, bytes.fromhex(grant.session_id)
        admit = Admission.make(key.key, session_id=session, epoch=1, holder="alice").to_wire()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(encode_frame(FrameType.DATA_OPEN, {"session": session.hex(), "admit": admit}))
            stream = s.makefile("rb")
            ready = read_frame(stream)
            assert ready is not None and ready.type is FrameType.DATA_READY, ready
            out = bytearray(256 + TAG_LEN)
            SendState(key, session_id=session).seal_into(os.urandom(256), out, frame_type=FrameType.CHUNK,
                                                         offset=0, length=256)
            s.sendall(encode_frame(FrameType.CHUNK, {"e": 1, "s": 0, "o": 0, "n": 256}, bytes(out)))
            ack = read_frame(stream)
            assert ack is not None and ack.type is FrameType.ACK, ack
        assert client.close_window(epoch=1).complete
        assert service.rejected_by_epoch == {}
    finally:
        attacker.kill()
        attacker.wait(10)
        client.close()
