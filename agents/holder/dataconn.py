"""The direct path's data connection: the agent's own connection to the device's data port, kept for its
session with that device, admitted for each hand-off's window (``Admission``: a MAC under the window's
key, core/device/admission.py; the device admits it for nothing at the window's RETURN), and the
shared-memory ring it may map on it (asked for with the first admission: one round trip; bound again with
each later one, without waiting).

On the device's Unix socket (same host) the connection can carry a shared-memory ring per hand-off (the
ciphertext is sealed straight into the ring's slots; only slot ids cross the socket); on TCP (holders on
other machines) chunks travel in frames. It speaks ``DataOpen`` and reads ``DataReady``
(``core.protocol.holderlink``)."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from gputravel.core.protocol import FrameType, encode_frame
from gputravel.core.protocol.errors import AgentError, GpuTravelError, HolderLinkError
from gputravel.core.protocol.frames import Frame, frame_head
from gputravel.core.protocol.holderlink import Admission, DataEndpoint, DataOpen, DataReady
from gputravel.core.protocol.shmring import RingSpec, ShmRing, recv_frame_with_fds, ring_supported

__all__ = ["BUSY_RETRY_S", "DataConn", "DataLinkLost", "RelayedFrame", "RingOffer"]

#: How long the agent keeps trying a data port that answers ``busy`` (every place for connections not yet
#: admitted is held by ones younger than the device's eviction age, 2 s: one is free or evictable by then).
BUSY_RETRY_S = 5.0


class DataLinkLost(AgentError):
    """The data connection to the device dropped (posted by its reader; names the connection)."""

    def __init__(self, reason: str, conn: DataConn) -> None:
        super().__init__("agent", reason)
        self.conn = conn


@dataclass(slots=True)
class RelayedFrame(Frame):
    """A HANDOFF the device relayed on this (parked) data connection, not read from the holder link: the agent
    takes it only as ``RelayedCopies.take`` allows (its key wrapped for this agent, of the epoch it attested)."""


@dataclass(frozen=True)
class RingOffer:
    """The device's DATA_READY for a ring request, with the ring's descriptor (owned by the receiver), or
    ``fd`` -1 where the device binds the ring this connection already maps."""

    conn: DataConn
    ready: DataReady
    fd: int


class DataConn:
    """One data connection from the agent to the device's data port, kept for the agent's session with
    that device."""

    def __init__(self, endpoint: DataEndpoint, session: bytes, inbox: queue.Queue[Any], *,
                 key: tuple[DataEndpoint, bytes], admit: Admission | None = None, ring: RingSpec | None = None) -> None:
        """Connect and be admitted (``admit``: the hand-off's credential); ``ring``: the first ring to ask for
        with it (same host), mapped here when the device grants it (``self.ring``), else chunks go in frames."""
        self.key = key
        self.session = session
        self.unix = endpoint.path is not None
        self.ring: ShmRing | None = None
        self.ring_slots: list[memoryview] = []
        want_rings = self.unix and ring_supported()
        opening = DataOpen(session.hex(), rings=want_rings, ring=ring if want_rings else None, admit=admit)
        deadline = time.monotonic() + BUSY_RETRY_S
        pause = 0.02
        while True:
            got = self._open(endpoint, opening)
            busy = got is not None and got[0].type is FrameType.ERROR and got[0].header.get("code") == "busy"
            if not busy or time.monotonic() + pause > deadline:
                break
            self.sock.close()  # every place on the port is taken by younger connections: one frees soon
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        frame = got[0] if got else None
        fds = list(got[1]) if got else []
        try:
            if frame is None or frame.type is not FrameType.DATA_READY:
                raise GpuTravelError(str(frame.header.get("reason")) if frame else "closed")
            ready = DataReady.from_wire(frame.header)
            if ready.ring is not None and fds and want_rings and ring is not None:
                if ready.ring != ring:
                    raise GpuTravelError(f"the device offered ring {ready.ring}, not {ring}")
                attached = ShmRing.attach(fds.pop(0), ring)
                self.set_ring(attached)
                attached.bind(epoch=ring.epoch)
        except GpuTravelError as exc:
            for fd in fds:
                os.close(fd)
            self.sock.close()
            raise HolderLinkError(f"the device refused the data connection: {exc.reason}") from None
        for fd in fds:
            os.close(fd)
        self.sock.settimeout(None)
        self.rings = want_rings and ready.rings  # the device offers rings on this connection
        self.inbox = inbox
        self.active = False  # a hand-off is using it: frames go to the inbox (between hand-offs they are dropped)
        self.closing = False
        self.dead = False
        self._send_lock = threading.Lock()
        #: a bind asked for and not yet answered (the agent seals meanwhile: ``ring_bind.open_ring``)
        self.awaiting: RingSpec | None = None
        threading.Thread(target=self._reader, name="agent-data-reader", daemon=True).start()

    def _open(self, endpoint: DataEndpoint, opening: DataOpen) -> tuple[Frame, list[int]] | None:
        """Connect, send DATA_OPEN and read the device's first answer (None: it closed)."""
        try:
            if endpoint.path is not None:  # same host: the device's Unix socket
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(30)
                self.sock.connect(endpoint.path)
            else:
                self.sock = socket.create_connection((str(endpoint.host), int(endpoint.port or 0)), timeout=30)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            self.sock.sendall(encode_frame(FrameType.DATA_OPEN, opening.to_wire()))
            return recv_frame_with_fds(self.sock)
        except (OSError, GpuTravelError) as exc:
            if hasattr(self, "sock"):
                self.sock.close()
            raise HolderLinkError(f"cannot reach the device data port {endpoint.to_wire()}: {exc}") from None

    def _reader(self) -> None:
        try:
            while True:
                got = recv_frame_with_fds(self.sock)
                if got is None:
                    break
                frame, fds = got
                if frame.type is FrameType.DATA_READY and "ring" in frame.header and self.active:
                    try:
                        offer = RingOffer(self, DataReady.from_wire(frame.header), fds[0] if fds else -1)
                    except GpuTravelError:  # a malformed answer: the bind waiting for it fails on the ERROR
                        for fd in fds:
                            os.close(fd)
                        self.inbox.put(HolderLinkError("the device's ring answer is malformed"))
                        continue
                    self.inbox.put(offer)
                    for fd in fds[1:]:
                        os.close(fd)
                    continue
                for fd in fds:
                    os.close(fd)
                if frame.type is FrameType.HANDOFF:  # relayed by the device, parked or not (Admissions.relay)
                    self.inbox.put(RelayedFrame(frame.type, frame.header, frame.payload))
                elif self.active:
                    self.inbox.put(frame)
        except (GpuTravelError, OSError, ValueError):
            pass
        self.dead = True
        if not self.closing and self.active:  # the device went away mid-transfer: fail the hand-off now
            self.inbox.put(DataLinkLost("the device closed the data connection", self))

    def set_ring(self, ring: ShmRing) -> None:
        self._drop_ring()
        self.ring = ring
        self.ring_slots = [ring.slot(k) for k in range(ring.spec.slots)]

    def _drop_ring(self) -> None:
        if self.ring is not None:
            for v in self.ring_slots:
                v.release()
            self.ring_slots = []
            self.ring.close(zero=True)
            self.ring = None

    def confirm_ring(self, offer: RingOffer) -> None:
        """The device's answer to a bind this connection did not wait for: it must bind the ring already
        mapped, in the shape and epoch asked for; anything else fails the hand-off. Answers nobody waits
        for (a descriptor included) are dropped."""
        spec, self.awaiting = self.awaiting, None
        if spec is None:
            if offer.fd >= 0:
                os.close(offer.fd)
            return
        if offer.fd >= 0:
            os.close(offer.fd)
            raise HolderLinkError("the device sent a new ring for a bind of the one this connection maps")
        if offer.ready.ring != spec:
            raise HolderLinkError(f"the device bound ring {offer.ready.ring}, not {spec}")

    def request_ring(self, spec: RingSpec, admit: Admission | None = None) -> None:
        """Bind a ring to this window (``admit``: admitted for the next window with it, in the same frame)."""
        with self._send_lock:
            self.sock.sendall(encode_frame(FrameType.DATA_OPEN,
                                           DataOpen(self.session.hex(), ring=spec, admit=admit).to_wire()))

    def readmit(self, admit: Admission) -> None:
        """Admitted for the next window (no ring): not waited for; a refusal fails the hand-off."""
        with self._send_lock:
            self.sock.sendall(encode_frame(FrameType.DATA_OPEN, DataOpen(self.session.hex(), admit=admit).to_wire()))

    def send(self, head: dict[str, Any], payload: bytes | bytearray | memoryview) -> None:
        """One chunk frame: header and payload in one ``sendmsg`` where the kernel takes it all."""
        parts = [memoryview(frame_head(FrameType.CHUNK, head, len(payload))), memoryview(payload)]
        with self._send_lock:
            while parts:
                sent = self.sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts and sent:
                    parts[0] = parts[0][sent:]

    def notify(self, head: dict[str, Any], _ct: memoryview, slot: int) -> None:
        """The chunk is sealed in ring slot ``slot``: only its header and the slot id cross the socket."""
        with self._send_lock:
            self.sock.sendall(frame_head(FrameType.CHUNK, {**head, "slot": slot}, 0))

    def close(self) -> None:
        self.closing = True
        try:
            with self._send_lock:
                self.sock.sendall(encode_frame(FrameType.BYE, {}))
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self._drop_ring()
        except BufferError:  # a slot view is still referenced (a failed hand-off's traceback): unmapped later
            self.ring = None
