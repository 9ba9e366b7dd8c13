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
import time
from typing import Any

import pytest
from helpers import ServeDevice, wait_for

from gputravel.core.api import tcp_data_host
from gputravel.core.config import RunSettings

NOBODY = 65534


@pytest.fixture
def device(serve_device: ServeDevice) -> tuple[Any, Any, str, Any]:
    """A real device service (real sockets, real keys) in this process, listening on its Unix socket and on a
    TCP data port, with small bounds: 4 connections may wait to authenticate per listener, for ``deadline``."""
    d = serve_device(data_host="127.0.0.1", max_pending=4, handshake_timeout=0.6)
    return d.service, d.server, d.sock, d.new_client


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
    """40 idle connections from another local user overflow the data port's budget (4): each newcomer is
    refused (``full``) or takes the place of one that has waited half the deadline (``evicted``); the
    orchestrator's control session on the Unix socket opens all the same, while they still stall."""
    service, server, _sock, new_client = device
    port = server.tcp.getsockname()[1]
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "40", "20"], stdout=subprocess.PIPE,
                                text=True)
    try:
        line = (attacker.stdout.readline() if attacker.stdout else "").split()
        assert len(line) == 2 and int(line[1]) >= 4
        if os.getuid() == 0:
            assert int(line[0]) == NOBODY
        assert wait_for(lambda: service.counts.refused["evicted"] + service.counts.refused["full"] >= 36)
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
    assert wait_for(lambda: service.counts.refused["timeout"] >= 1)
    assert service.counts.refused["timeout"] == 1


def assert_one_chunk_acked(s: socket.socket, stream: Any, key: Any, session: bytes) -> None:
    """Send one sealed 256-byte chunk of epoch 1 on an admitted data connection; its ACK comes back."""
    from gputravel.core.protocol import TAG_LEN, FrameType, SendState, encode_frame, read_frame

    out = bytearray(256 + TAG_LEN)
    SendState(key, session_id=session).seal_into(os.urandom(256), out, frame_type=FrameType.CHUNK, offset=0,
                                                 length=256)
    s.sendall(encode_frame(FrameType.CHUNK, {"e": 1, "s": 0, "o": 0, "n": 256}, bytes(out)))
    ack = read_frame(stream)
    assert ack is not None and ack.type is FrameType.ACK, ack


def test_strangers_filling_the_tcp_ports_places_cannot_keep_an_admitted_holder_out(
        device: tuple[Any, Any, str, Any]) -> None:
    """Another local user holds more connections open on the TCP data port than it has places (40 > 4); a
    holder's data connection, refused as ``busy`` while the strangers' places are young and trying again as
    the agent does, gets in once they have waited ``evict_after`` (half the deadline) and its chunk lands,
    and nothing the strangers did is charged to the holder's window."""
    from gputravel.core.protocol import FrameType, encode_frame, read_frame
    from gputravel.core.protocol.holderlink import Admission

    service, server, _sock, new_client = device
    port = server.tcp.getsockname()[1]
    client = new_client()
    client.connect()
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "40", "20"], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline()
        assert wait_for(lambda: service.counts.refused["evicted"] + service.counts.refused["full"] >= 30), dict(service.counts.refused)
        grant = client.handoff(epoch=1, offset=0, length=256, chunk_size=256)
        key, session = grant.provisioning_key, bytes.fromhex(grant.session_id)
        admit = Admission.make(key.key, session_id=session, epoch=1, holder="alice").to_wire()
        tries, since = 0, time.monotonic()
        while True:  # as the agent does (agents/holder/dataconn.py): try again while the port answers busy
            tries += 1
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(encode_frame(FrameType.DATA_OPEN, {"session": session.hex(), "admit": admit}))
            stream = s.makefile("rb")
            ready = read_frame(stream)
            if ready is None or ready.type is not FrameType.ERROR or ready.header.get("code") != "busy":
                break
            s.close()
            time.sleep(0.05)
        with s:
            # the strangers' places are taken from them once they have waited half the deadline (0.3 s)
            assert time.monotonic() - since < 0.3 + 1.0, (tries, dict(service.counts.refused))
            assert ready is not None and ready.type is FrameType.DATA_READY, ready
            assert_one_chunk_acked(s, stream, key, session)
        assert client.close_window(epoch=1).complete
        assert service.counts.rejected_by_epoch == {}
    finally:
        attacker.kill()
        attacker.wait(10)
        client.close()


def test_a_flood_arriving_before_a_holders_late_data_open_does_not_push_it_out(serve_device: ServeDevice) -> None:
    """Issue 30, item 7: a holder's data connection is admitted to a place, then 40 idle connections flood the
    port (4 places) before its DATA_OPEN is read. The holder keeps its place (a place is only taken from a
    connection that has waited ``evict_after``): the flood is refused as ``full`` with an ERROR frame, the late
    DATA_OPEN is admitted and its chunk acknowledged; once the flood's placed connections have waited past
    ``evict_after``, a newcomer takes the oldest one's place (``evicted``)."""
    from gputravel.core.protocol import FrameType, encode_frame, read_frame
    from gputravel.core.protocol.holderlink import Admission

    d = serve_device(data_host="127.0.0.1", max_pending=4, handshake_timeout=4.0, evict_after=1.0)
    service, server = d.service, d.server
    assert server.tcp is not None
    port = server.tcp.getsockname()[1]
    client = d.new_client()
    client.connect()
    flood: list[socket.socket] = []
    try:
        grant = client.handoff(epoch=1, offset=0, length=256, chunk_size=256)
        key, session = grant.provisioning_key, bytes.fromhex(grant.session_id)
        admit = Admission.make(key.key, session_id=session, epoch=1, holder="alice").to_wire()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert wait_for(lambda: len(server._pending_tcp) == 1)  # the holder's connection has its place
            flooded_at = time.monotonic()
            flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
            assert wait_for(lambda: service.counts.refused["full"] >= 37), dict(service.counts.refused)
            assert service.counts.refused["evicted"] == 0 and len(server._pending_tcp) == 4
            refused = read_frame(flood[-1].makefile("rb"))
            assert refused is not None and refused.type is FrameType.ERROR and refused.header["code"] == "busy"
            time.sleep(0.3)  # the holder's DATA_OPEN comes late, after the whole flood
            s.sendall(encode_frame(FrameType.DATA_OPEN, {"session": session.hex(), "admit": admit}))
            stream = s.makefile("rb")
            ready = read_frame(stream)
            assert ready is not None and ready.type is FrameType.DATA_READY, ready
            assert_one_chunk_acked(s, stream, key, session)
        assert client.close_window(epoch=1).complete
        assert service.counts.rejected_by_epoch == {}
        time.sleep(max(0.0, flooded_at + 1.2 - time.monotonic()))  # the flood's 3 placed ones are past 1.0 s
        assert wait_for(lambda: len(server._pending_tcp) == 3)
        flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))  # a 4th place is free
        flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))  # takes the oldest's place
        assert wait_for(lambda: service.counts.refused["evicted"] == 1), dict(service.counts.refused)
        assert len(server._pending_tcp) == 4
    finally:
        for f in flood:
            f.close()
        client.close()
