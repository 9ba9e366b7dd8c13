"""Admission that names who is speaking, and budgets per holder window (issue 24), written as the attacker.

Every holder learns the device's session id at its hand-off. Before admission, that id was all a data
connection needed: garbage sent while another holder's window was open was charged to that holder, and one
holder could take every ring of another's epoch. Now a data connection is admitted for one window by a MAC
under that window's key (core/device/admission.py); the attacker here is a raw socket that knows the session
id, and a holder that knows its own keys but not the others'.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from helpers import ConnectedDevice, wait_for

from gputravel.core.device.admission import (
    MAX_CONNECTIONS_PER_WINDOW,
    MAX_IDLE_CONNECTIONS,
    MAX_RINGS_PER_WINDOW,
)
from gputravel.core.protocol import TAG_LEN, FrameType, SendState, encode_frame
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.protocol.keys import DirectionKey
from gputravel.core.protocol.shmring import RingSpec, ShmRing, recv_frame_with_fds, ring_supported

CHUNK = 256


class Device(ConnectedDevice):
    """A real device service and server in this process (its counters and rings are inspected directly)."""

    def __init__(self, connected: ConnectedDevice) -> None:
        super().__init__(connected.service, connected.server, connected.sock, connected.client)
        self.epoch = 0

    def handoff(self, length: int = 4 * CHUNK) -> tuple[int, DirectionKey, bytes]:
        self.epoch += 1
        grant = self.client.handoff(epoch=self.epoch, offset=0, length=length, chunk_size=CHUNK)
        return self.epoch, grant.provisioning_key, bytes.fromhex(grant.session_id)

    def close(self, epoch: int) -> Any:
        return self.client.close_window(epoch=epoch)

    def charged(self) -> dict[int, dict[str, int]]:
        return {e: dict(c) for e, c in self.service.counts.rejected_by_epoch.items()}


@pytest.fixture
def device(connected_device: ConnectedDevice) -> Device:
    return Device(connected_device)


class Raw:
    """The attacker's raw data connection (or a holder's, when it admits with its window key)."""

    def __init__(self, dev: Device, head: dict[str, Any]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(dev.sock)
        self.sock.sendall(encode_frame(FrameType.DATA_OPEN, head))
        got = recv_frame_with_fds(self.sock)
        assert got is not None
        self.first, self.fds = got

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> Any:
        self.sock.sendall(encode_frame(ftype, header, payload))
        got = recv_frame_with_fds(self.sock)
        return None if got is None else got[0]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.sock.close()


def opening(session: bytes, key: DirectionKey | None = None, epoch: int = 0, holder: str = "alice",
            **extra: Any) -> dict[str, Any]:
    head: dict[str, Any] = {"session": session.hex(), **extra}
    if key is not None:
        head["admit"] = Admission.make(key.key, session_id=session, epoch=epoch, holder=holder).to_wire()
    return head


def sealed(key: DirectionKey, session: bytes, seq: int, *, tamper: bool = False) -> tuple[dict[str, Any], bytes]:
    out = bytearray(CHUNK + TAG_LEN)
    SendState(key, session_id=session, start=seq).seal_into(os.urandom(CHUNK), out, frame_type=FrameType.CHUNK,
                                                            offset=seq * CHUNK, length=CHUNK)
    if tamper:
        out[5] ^= 1
    return {"e": key.epoch, "s": seq, "o": seq * CHUNK, "n": CHUNK}, bytes(out)


# --- (a) garbage is charged to the holder that sent it, never to another ------------------------------
def test_garbage_on_an_unadmitted_connection_during_alices_window_charges_nobody(device: Device) -> None:
    epoch, key, session = device.handoff()  # alice's window is open
    mallory_key = DirectionKey(os.urandom(32), key.prefix, epoch, key.direction)  # a key mallory made up
    for head in (opening(session),  # the session id alone
                 opening(session, mallory_key, epoch, holder="alice"),  # a credential that does not verify
                 {"session": session.hex(), "admit": {"epoch": epoch, "holder": "alice", "nonce": "00" * 16,
                                                      "mac": "ff" * 32}}):
        conn = Raw(device, head)
        assert conn.first.type is FrameType.ERROR and conn.first.header["code"] in ("admission",), conn.first
        conn.close()
    # garbage chunks as a first frame, on the Unix socket and the TCP port
    for addr in (device.sock, ("127.0.0.1", device.server.tcp.getsockname()[1])):
        with socket.socket(socket.AF_UNIX if isinstance(addr, str) else socket.AF_INET) as s:
            s.settimeout(10)
            s.connect(addr)
            s.sendall(encode_frame(FrameType.CHUNK, *sealed(key, session, 0, tamper=True)))
            assert recv_frame_with_fds(s) is not None
    assert device.service.counts.refused["anonymous"] == 3
    assert device.charged() == {}  # misattributed rejections: 0 (alice is charged nothing)
    # alice's own connection: her genuine chunks in, her own garbage charged to her window
    alice = Raw(device, opening(session, key, epoch))
    assert alice.first.type is FrameType.DATA_READY
    assert alice.send(FrameType.CHUNK, *sealed(key, session, 0)).type is FrameType.ACK
    assert alice.send(FrameType.CHUNK, *sealed(key, session, 1, tamper=True)).header["code"] == "tag"
    alice.close()
    assert device.charged() == {epoch: {"tag": 1}}
    device.close(epoch)


def test_a_replayed_admission_is_refused_and_charges_nobody(device: Device) -> None:
    """A credential captured on the wire (its nonce admitted once in this window) proves nothing on a
    second connection."""
    epoch, key, session = device.handoff()
    head = opening(session, key, epoch)
    first = Raw(device, head)
    assert first.first.type is FrameType.DATA_READY
    again = Raw(device, head)
    assert again.first.type is FrameType.ERROR and "used before" in again.first.header["reason"]
    again.close()
    first.close()
    assert device.charged() == {} and device.service.counts.refused["anonymous"] == 1
    device.close(epoch)


# --- (b) the session id without the window key binds nothing ------------------------------------------
@pytest.mark.skipif(not ring_supported(), reason="no memfd here")
def test_a_holder_without_the_window_key_cannot_bind_rings_for_another_holders_epoch(device: Device) -> None:
    m_epoch, m_key, session = device.handoff()  # mallory's own window (she connects in it), then alice's
    Raw(device, opening(session, m_key, m_epoch, holder="mallory")).close()
    assert device.close(m_epoch).complete is False
    epoch, key, _ = device.handoff()
    spec = RingSpec(epoch, 4, CHUNK + TAG_LEN)
    attempts = [opening(session, None, rings=1, ring=spec.to_wire()),  # no credential
                opening(session, m_key, epoch, holder="alice", rings=1, ring=spec.to_wire())]  # mallory's key
    for head in attempts:
        conn = Raw(device, head)
        assert conn.first.type is FrameType.ERROR and conn.fds == []
        conn.close()
    # mallory's own (closed) window: admitted never again, charged to mallory's window only
    stale = Raw(device, opening(session, m_key, m_epoch, holder="mallory", rings=1, ring=spec.to_wire()))
    assert stale.first.header["code"] == "stale-epoch" and stale.fds == []
    stale.close()
    assert device.service.plane.rings_of(epoch) == 0
    assert device.charged() == {m_epoch: {"stale-epoch": 1}}  # nothing charged to alice's epoch
    # alice's own ring comes with her admission, in one answer
    alice = Raw(device, opening(session, key, epoch, rings=1, ring=spec.to_wire()))
    assert alice.first.type is FrameType.DATA_READY and len(alice.fds) == 1
    assert device.service.plane.rings_of(epoch) == 1
    # an admitted connection asking for a ring of another epoch: refused, charged to its own window
    other = alice.send(FrameType.DATA_OPEN, {"session": session.hex(),
                                             "ring": RingSpec(epoch + 1, 4, CHUNK + TAG_LEN).to_wire()})
    assert other.header["code"] == "stale-epoch" and other.header["ring"] == 1
    assert device.charged()[epoch] == {"stale-epoch": 1}
    alice.close()
    device.close(epoch)


# --- (c) budgets per holder window --------------------------------------------------------------------
@pytest.mark.skipif(not ring_supported(), reason="no memfd here")
def test_a_holder_over_its_budget_is_refused_and_the_next_holders_window_completes(device: Device) -> None:
    epoch, key, session = device.handoff()
    greedy = [Raw(device, opening(session, key, epoch, holder="mallory", rings=1,
                                  ring=RingSpec(epoch, 2, CHUNK + TAG_LEN).to_wire()))
              for _ in range(MAX_CONNECTIONS_PER_WINDOW + 3)]
    admitted = [c for c in greedy if c.first.type is FrameType.DATA_READY]
    refused = [c for c in greedy if c.first.type is FrameType.ERROR]
    assert len(admitted) == MAX_CONNECTIONS_PER_WINDOW and len(refused) == 3
    assert all(c.first.header["code"] == "budget" for c in refused)
    assert device.service.plane.rings_of(epoch) == MAX_RINGS_PER_WINDOW
    # a ring of another shape would be one more ring of this window: over budget
    reshape = admitted[0].send(FrameType.DATA_OPEN, {"session": session.hex(),
                                                     "ring": RingSpec(epoch, 3, CHUNK + TAG_LEN).to_wire()})
    assert reshape.header["code"] == "budget"
    assert device.charged() == {epoch: {"budget": 4}}  # charged to the greedy holder's window only
    device.close(epoch)  # RETURN: its connections are admitted for nothing
    for c in greedy:
        c.close()
    # the next holder's window: its own budget, every chunk in
    b_epoch, b_key, _ = device.handoff()
    bob = Raw(device, opening(session, b_key, b_epoch, holder="bob", rings=1,
                              ring=RingSpec(b_epoch, 2, CHUNK + TAG_LEN).to_wire()))
    assert bob.first.type is FrameType.DATA_READY and len(bob.fds) == 1
    for seq in range(4):
        assert bob.send(FrameType.CHUNK, *sealed(b_key, session, seq)).type is FrameType.ACK
    assert device.close(b_epoch).complete is True
    bob.close()
    assert b_epoch not in device.charged()


# --- (d) RETURN closes everything of the window; nothing grows without bound --------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not ring_supported() or not os.path.isdir("/proc/self/fd"), reason="no memfd or /proc here")
def test_return_releases_the_windows_rings_and_admits_its_connections_for_nothing_and_50_attempts_leave_nothing(
        device: Device) -> None:
    """RETURN zeroes and unbinds the window's rings and admits its connections for nothing (what they send
    then is anonymous); idle connections are bounded (the oldest shut down); 50 windows and 50 unadmitted
    attempts leave no descriptor, ring or admission behind."""
    svc = device.service

    def one_window(*, keep: bool = False) -> Raw:
        epoch, key, session = device.handoff()
        spec = RingSpec(epoch, 2, CHUNK + TAG_LEN)
        conn = Raw(device, opening(session, key, epoch, rings=1, ring=spec.to_wire()))
        assert conn.first.type is FrameType.DATA_READY and svc.plane.rings_of(epoch) == 1
        ring = ShmRing.attach(conn.fds.pop(), spec)
        assert svc.plane.admissions.connections(epoch) == 1
        head, ct = sealed(key, session, 0)
        ring.slot(0)[: len(ct)] = ct
        assert conn.send(FrameType.CHUNK, {**head, "slot": 0}).type is FrameType.ACK
        device.close(epoch)
        assert svc.plane.rings_of(epoch) == 0 and not any(ring.slot(0))  # released and zeroed at RETURN
        assert svc.plane.admissions.connections(epoch) == 0
        late = conn.send(FrameType.CHUNK, {**head, "s": 1, "o": CHUNK, "slot": 0})
        assert late.type is FrameType.ERROR and late.header["code"] == "stale-epoch"
        assert epoch not in device.charged()  # admitted for no window: anonymous
        ring.close(zero=False)
        if not keep:
            conn.close()  # the agent goes away: the device's thread ends and unmaps the ring
        return conn

    one_window()  # warm: slot sets and threads made once
    assert wait_for(lambda: svc.plane.admissions.idle() == 0)
    before = _open_fds()
    for _ in range(50):
        one_window()
    _, key, session = device.handoff()
    for _ in range(50):  # and 50 that are never admitted
        Raw(device, opening(session)).close()
    assert wait_for(lambda: _open_fds() <= before + 1), (before, _open_fds())
    assert not svc.plane.rings and svc.plane.admissions.connections() == 0 and svc.plane.admissions.idle() == 0
    assert len(svc.plane.admissions._windows) <= 9  # closed windows remembered: a bounded few
    device.close(device.epoch)
    # connections kept open between windows: at most MAX_IDLE_CONNECTIONS wait, the oldest are shut down
    kept = [one_window(keep=True) for _ in range(MAX_IDLE_CONNECTIONS + 3)]
    assert svc.plane.admissions.idle() == MAX_IDLE_CONNECTIONS
    assert all(recv_frame_with_fds(c.sock) is None for c in kept[:3])
    for c in kept:
        c.close()


# --- (e) the hand-off's relay: a HANDOFF goes only to its own holder's parked connection -----------------
def test_a_relayed_handoff_reaches_only_its_holders_parked_connection_and_a_dead_one_answers_false(
        device: Device) -> None:
    """``Op.RELAY`` writes the open window's HANDOFF (its key wrapped for the holder) on the newest connection parked
    for the holder named: never on another holder's, never for a window not open, never with a bare key; a holder
    with no parked connection, or whose connection died, gets False (the holder link's copy then carries it)."""
    from gputravel.core.errors import DeviceError, StaleEpochError

    svc = device.service
    parked: dict[str, Raw] = {}
    for holder in ("alice", "bob"):  # each admitted for a window of its own, which returns: parked, bound to it
        epoch, key, session = device.handoff()
        parked[holder] = Raw(device, opening(session, key, epoch, holder=holder))
        assert parked[holder].first.type is FrameType.DATA_READY
        device.close(epoch)
    assert svc.plane.admissions.parked("alice") == svc.plane.admissions.parked("bob") == 1
    epoch, key, session = device.handoff()
    head = {"epoch": epoch, "session": session.hex(), "wrapped_key": "ab" * 40, "key_fp": "f" * 16, "relay": "01" * 8}
    assert device.client.relay(holder="alice", epoch=epoch, handoff=head) is True
    got = recv_frame_with_fds(parked["alice"].sock)
    assert got is not None and got[0].type is FrameType.HANDOFF and got[0].header == head
    # the relayed hand-off's admission on that connection: refused by name without the window's key, then admitted
    forged = DirectionKey(os.urandom(32), key.prefix, epoch, key.direction)
    refused = parked["alice"].send(FrameType.DATA_OPEN, opening(session, forged, epoch))
    assert refused.type is FrameType.ERROR and refused.header["code"] == "admission"
    admitted = parked["alice"].send(FrameType.DATA_OPEN, opening(session, key, epoch))
    assert admitted.type is FrameType.DATA_READY and svc.plane.admissions.connections(epoch) == 1
    parked["bob"].sock.settimeout(0.2)
    with pytest.raises(TimeoutError):  # nothing for bob: another holder's hand-off never reaches it
        parked["bob"].sock.recv(1)
    assert device.client.relay(holder="carol", epoch=epoch, handoff=head) is False  # no connection parked for carol
    with pytest.raises(DeviceError, match="wrapped"):  # a bare key never leaves the holder link
        device.client.relay(holder="alice", epoch=epoch, handoff={**head, "key": {"k": "00"}})
    with pytest.raises(StaleEpochError):  # only for the window open now
        device.client.relay(holder="alice", epoch=epoch - 1, handoff={**head, "epoch": epoch - 1})
    parked["bob"].close()  # bob's agent went away: its parked connection is dead
    assert device.client.relay(holder="bob", epoch=epoch, handoff=head) is False
    assert svc.counts.counters["relayed"] == 1 and svc.counts.counters["relay_missed"] == 2
    parked["alice"].close()
    device.close(epoch)


def test_a_handoff_inside_its_window_request_reaches_only_its_holders_parked_connection(device: Device) -> None:
    """The window's request carrying its HANDOFF (``Op.HANDOFF``'s ``relay``): the device opens the window and
    writes the HANDOFF on the holder's newest parked connection, only if it is of that window's epoch and key
    (``key_fp``: the orchestrator derived the key the device does) and wrapped; a malformed one is refused before
    any window opens; another holder's connection is never written to; no parked connection, a dead one, or a
    HANDOFF of another key answers ``relayed`` False, with the window open all the same (the holder link's copy is
    the fallback)."""
    from gputravel.core.errors import DeviceError, StaleEpochError
    from gputravel.core.protocol import Direction, provisioning_key

    svc, client = device.service, device.client
    parked: dict[str, Raw] = {}
    for holder in ("alice", "bob"):
        epoch, key, session = device.handoff()
        parked[holder] = Raw(device, opening(session, key, epoch, holder=holder))
        assert parked[holder].first.type is FrameType.DATA_READY
        device.close(epoch)
    secrets = client.secrets
    assert secrets is not None

    def wrapped(epoch: int) -> dict[str, Any]:  # what the orchestrator wraps before the window opens
        key = provisioning_key(secrets.master, secrets.session_id, epoch=epoch, offset=0, length=4 * CHUNK,
                               direction=Direction.HOLDER_TO_DEVICE)
        return {"epoch": epoch, "session": secrets.session_id.hex(), "wrapped_key": "ab" * 40, "key_fp": key.fingerprint,
                "relay": os.urandom(8).hex()}

    def request(epoch: int, holder: str, head: dict[str, Any]) -> Any:
        return client.handoff(epoch=epoch, offset=0, length=4 * CHUNK, chunk_size=CHUNK, relay=(holder, head))

    epoch = device.epoch + 1
    head = wrapped(epoch)
    with pytest.raises(DeviceError, match="wrapped"):  # a bare key never leaves the holder link
        request(epoch, "alice", {**head, "key": {"k": "00"}})
    with pytest.raises(StaleEpochError):  # a HANDOFF of another window
        request(epoch, "alice", {**head, "epoch": epoch + 1})
    with pytest.raises(DeviceError, match="holder"):
        request(epoch, "", head)
    assert svc.windows.window is None and svc.windows.epoch == epoch - 1  # nothing changed
    grant = request(epoch, "alice", head)
    device.epoch = epoch
    assert grant.relayed is True and grant.key_fingerprint == head["key_fp"]
    got = recv_frame_with_fds(parked["alice"].sock)
    assert got is not None and got[0].type is FrameType.HANDOFF and got[0].header == head
    admitted = parked["alice"].send(FrameType.DATA_OPEN, opening(bytes.fromhex(grant.session_id),
                                                                 grant.provisioning_key, epoch))
    assert admitted.type is FrameType.DATA_READY and svc.plane.admissions.connections(epoch) == 1
    parked["bob"].sock.settimeout(0.2)
    with pytest.raises(TimeoutError):  # nothing for bob
        parked["bob"].sock.recv(1)
    device.close(epoch)  # alice's connection parks again
    epoch += 1
    other = {**wrapped(epoch), "key_fp": "f" * 16}  # wrapped for a key this window does not have
    assert request(epoch, "alice", other).relayed is False and svc.windows.window is not None
    parked["alice"].sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        parked["alice"].sock.recv(1)
    device.close(epoch)
    epoch += 1
    assert request(epoch, "carol", wrapped(epoch)).relayed is False  # no connection parked for carol
    device.close(epoch)
    parked["bob"].close()  # bob's agent went away
    epoch += 1
    assert request(epoch, "bob", wrapped(epoch)).relayed is False and svc.windows.window is not None
    device.epoch = epoch
    assert svc.counts.counters["relayed"] == 1 and svc.counts.counters["relay_missed"] == 3
    parked["alice"].close()
    device.close(epoch)
