"""The device's data connections: ciphertext chunks in (in frames, or as slot ids of a shared-memory ring),
acknowledgements out, on a thread of their own.

A data connection is admitted for one holder's window by its first DATA_OPEN (core/device/admission.py); every
refusal on it is charged to that window, or counted anonymous. :class:`DataConnection` owns one connection's
state (its admitted epoch, its ring receiver, the acknowledgements it holds back); it reaches the device only
through :class:`DataPath`, the service's parts a data connection needs (the session, the counts, the windows,
the intake and the data plane), given at construction. The listener (core/device/server.py) hands a
connection here once its first frame says DATA_OPEN.
"""

from __future__ import annotations

import functools
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputravel.core.device.admission import MAX_RINGS_PER_WINDOW, AdmissionRefused
from gputravel.core.device.counters import Counters
from gputravel.core.device.dataplane import DataPlane, SlotSet
from gputravel.core.device.intake import ChunkIntake
from gputravel.core.device.pending import Pending
from gputravel.core.device.session_keys import DeviceSecrets
from gputravel.core.device.window import MAX_CHUNK, BufferWindows
from gputravel.core.errors import ProtocolError
from gputravel.core.protocol import TAG_LEN, Frame, FrameError, FrameType, StaleEpochError, encode_frame
from gputravel.core.protocol.devicelink import error_header, send_frame
from gputravel.core.protocol.frames import encode_ack_batch, read_frame_into
from gputravel.core.protocol.holderlink import DataOpen, DataReady
from gputravel.core.protocol.shmring import RingReceiver, ring_supported, send_frame_with_fd

__all__ = ["ACK_BATCH", "DataConnection", "DataPath", "serve_data"]


@dataclass(frozen=True, slots=True)
class DataPath:
    """The parts of a device service a data connection reaches (``DeviceService.data_path``)."""

    keys: DeviceSecrets
    counts: Counters
    windows: BufferWindows
    intake: ChunkIntake
    plane: DataPlane


def serve_data(path: DataPath, conn: socket.socket, stream: Any, first: Frame, pending: Pending) -> None:
    """A data connection: admitted for one holder's window by its first DATA_OPEN (``Admission``), or
    refused and counted as anonymous (core/device/admission.py); then served until it ends."""
    secrets = path.keys.secrets
    opening = DataOpen.from_wire(first.header)  # malformed: FrameError, refused and counted by the listener (DeviceServer._handle)
    if secrets is None or opening.session_id != secrets.session_id.hex():
        path.counts.count_refused("stale-epoch")
        send_frame(conn, FrameType.ERROR, {"code": "stale-epoch", "reason": "no such session"})
        return
    session = secrets.session_id.hex()
    if opening.admit is None:
        path.counts.count_refused("anonymous")
        send_frame(conn, FrameType.ERROR, {"code": "admission",
                                           "reason": "a data connection must be admitted for a window"})
        return
    # shared-memory rings only where the holder shares this host: on the Unix socket, when asked for
    rings = conn.family == socket.AF_UNIX and ring_supported() and opening.rings
    slots = path.plane.take_slots()  # this connection's receive buffers, reused from an earlier one
    data = DataConnection(path, conn, stream, slots, session=session, rings=rings)
    try:
        try:
            path.plane.admissions.admit(path.windows, path.keys, opening.admit, conn, data.deadmit, data.deliver)
        except AdmissionRefused as refused:
            if refused.charge is None:
                path.counts.count_refused("anonymous")
            else:
                path.counts.count_rejection(refused.error.code, refused.charge)
            send_frame(conn, FrameType.ERROR, error_header(refused.error))
            return
        data.epoch = opening.admit.epoch
        pending.authenticated()  # admitted: it speaks for this (holder, epoch) until RETURN
        if opening.ring is not None and rings:  # the first ring rides with the admission: one round trip
            data.open_ring(first.header, ready_rings=True)
        else:
            send_frame(conn, FrameType.DATA_READY, DataReady(session, rings=rings).to_wire())
        data.serve()
    finally:
        path.plane.admissions.leave(conn)
        with path.windows.lock:  # a relayed window's request held for completion stops waiting for a gone agent
            path.windows.completed.notify_all()
        data.close()
        path.plane.give_slots(slots)


#: Most acknowledgements one data connection holds back before it sends them in one frame (on a ring, at
#: most half its slots, so the agent always has slots to seal into while the other half is acknowledged).
ACK_BATCH = 4


class DataConnection:
    """One data connection: sealed chunks in (in frames, or as slot ids of a shared-memory ring), ACK and
    ERROR out. This thread keeps receiving while the service's decrypt workers (if any) open earlier
    chunks; acknowledgements go out as chunks reach device memory, in any order."""

    def __init__(self, path: DataPath, conn: socket.socket, stream: Any, slots: SlotSet, *, session: str,
                 rings: bool) -> None:
        self.path, self.conn, self.stream, self.slots = path, conn, stream, slots
        self.session = session
        #: the admitted window: every refusal here is charged to it (its holder); None once it returned
        #: (refusals then are anonymous) until the connection is admitted for the holder's next window
        self.epoch: int | None = None
        self.rings = rings
        self.receiver: RingReceiver | None = None
        self._send_lock = threading.Lock()
        # Batched acknowledgements (an agent that marks its chunks with ``f`` allows them): up to ACK_BATCH
        # held back, all sent once a chunk marked ``f: 1`` (the agent is about to wait) and every chunk before
        # it are settled. One ACK frame then frees several of the agent's slots (one wake-up, not one per chunk).
        self._acks: list[tuple[int, Any]] = []
        self._ack_epoch: Any = None
        self._ack_contiguous = 0
        self._batched_inflight = 0
        self._flush_wanted = False
        self._ack_batch = ACK_BATCH

    def send(self, ftype: FrameType, header: dict[str, Any]) -> None:
        with self._send_lock:
            send_frame(self.conn, ftype, header)

    def deliver(self, frame: bytes) -> None:
        """Write one encoded frame (a relayed HANDOFF, ``Admissions.relay``) between this connection's own."""
        with self._send_lock:
            self.conn.sendall(frame)

    def serve(self) -> None:
        path = self.path
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(self.slots)):
            free.put(i)
        while True:
            i = free.get()  # blocks while every buffer's chunk is still being opened: back-pressure
            try:
                frame = read_frame_into(self.stream, functools.partial(self.slots.get, i),
                                        max_payload=MAX_CHUNK + TAG_LEN)
            except FrameError as exc:
                path.counts.count_rejection(exc.code, self.epoch)
                self.send(FrameType.ERROR, error_header(exc))
                return
            if frame is None:
                return
            header = frame.header
            if frame.type is FrameType.CHUNK and "slot" in header:
                free.put(i)
                self._ring_chunk(header, len(frame.payload))
            elif frame.type is FrameType.CHUNK:
                self._chunk(header, frame.payload, release=functools.partial(free.put, i), slot=None)
            elif frame.type is FrameType.DATA_OPEN and "admit" in header:
                free.put(i)
                self._readmit(header)
            elif frame.type is FrameType.DATA_OPEN and "ring" in header:
                free.put(i)
                self.open_ring(header)
            else:
                free.put(i)
                if not self._non_chunk(frame):
                    return

    def _reply(self, header: Any, slot: Any) -> Callable[[dict[str, Any] | None, BaseException | None], None]:
        s = header.get("s") if isinstance(header, dict) else None
        extra = {} if slot is None else {"slot": slot}

        def reply(ack: dict[str, Any] | None, exc: BaseException | None) -> None:
            try:
                if exc is None:
                    self.send(FrameType.ACK, {**(ack or {}), **extra})
                else:
                    self.send(FrameType.ERROR, {**error_header(exc), "s": s, **extra})
            except OSError:
                pass

        return reply

    def _batched_reply(self, header: dict[str, Any], slot: Any, flush: bool
                       ) -> Callable[[dict[str, Any] | None, BaseException | None], None]:
        """The answer to a chunk whose acknowledgement may wait for others (see ``_acks``); a refusal is
        sent at once, after the acknowledgements held back."""
        s = header.get("s")
        with self._send_lock:
            self._batched_inflight += 1
            self._flush_wanted = self._flush_wanted or flush

        def reply(ack: dict[str, Any] | None, exc: BaseException | None) -> None:
            with self._send_lock:
                self._batched_inflight -= 1
                if exc is None and ack is not None:
                    self._acks.append((int(ack["s"]), slot))
                    contiguous = int(ack.get("contiguous", 0))
                    if ack.get("e") != self._ack_epoch:  # a new hand-off on this long-lived connection
                        self._ack_epoch, self._ack_contiguous = ack.get("e"), contiguous
                    else:  # workers may settle out of order: the furthest point reached
                        self._ack_contiguous = max(self._ack_contiguous, contiguous)
                settled = self._batched_inflight == 0
                try:
                    if exc is not None or len(self._acks) >= self._ack_batch or (self._flush_wanted and settled):
                        self._send_acks()
                    if exc is not None:
                        send_frame(self.conn, FrameType.ERROR,
                                   {**error_header(exc), "s": s, **({} if slot is None else {"slot": slot})})
                except OSError:
                    pass
                if settled:
                    self._flush_wanted = False

        return reply

    def _send_acks(self) -> None:
        """Send the acknowledgements held back as one ACK frame (the send lock held)."""
        if not self._acks:
            return
        acks, self._acks = self._acks, []
        batch = [s for s, _ in acks]
        slots = None if acks[0][1] is None else [k for _, k in acks]
        epoch, contiguous = self._ack_epoch, self._ack_contiguous
        if type(epoch) is int and (slots is None or all(type(k) is int for k in slots)):
            self.conn.sendall(encode_ack_batch(batch, slots, epoch, contiguous))  # the same bytes, no JSON encoder
            return
        head: dict[str, Any] = {"batch": batch, "e": epoch, "contiguous": contiguous}
        if slots is not None:
            head["slots"] = slots
        send_frame(self.conn, FrameType.ACK, head)

    def _chunk(self, header: Any, payload: Any, *, release: Callable[[], None], slot: Any) -> None:
        if isinstance(header, dict) and "f" in header:  # this agent takes batched acknowledgements
            flush = header.pop("f") == 1
            reply = self._batched_reply(header, slot, flush)
        else:
            reply = self._reply(header, slot)
        claimed = header.get("e") if isinstance(header, dict) else None
        w = self.path.windows.window
        if type(claimed) is int and claimed != self.epoch and w is not None and claimed == w.epoch:
            # another holder's open window: never written through this connection (charged to its own)
            self.path.counts.count_rejection("stale-epoch", self.epoch)
            release()
            reply(None, StaleEpochError(f"this connection is admitted for epoch {self.epoch}, not {claimed}"))
            return

        def work() -> None:
            try:
                self.path.intake.submit_chunk(header, payload, reply, charge=self.epoch)
            finally:
                release()

        plane = self.path.plane
        # decrypt workers open every chunk; without them, a chunk that came in a frame may be opened on the
        # frame thread while this one receives the next frame (``DataPlane.frame_pool``)
        pool = plane.pool or (plane.frame_pool if slot is None else None)
        if pool is not None:
            try:
                pool.submit(work)
                return
            except RuntimeError:  # the pool was replaced (set_data_path) meanwhile: open it here
                pass
        work()

    def _ring_chunk(self, header: dict[str, Any], payload_len: int) -> None:
        """A chunk sealed into ring slot ``slot``: the slot and length are checked against the ring, then
        the chunk is checked and opened exactly as one that came in a frame."""
        slot = header.get("slot")
        try:
            if payload_len:
                raise FrameError("a ring chunk's frame carries no payload (the chunk is in its slot)")
            if self.receiver is None:
                raise FrameError("no shared-memory ring is open on this connection")
            chunk_header, ciphertext = self.receiver.take(header)
        except ProtocolError as exc:
            self.path.counts.count_rejection(exc.code, self.epoch)
            with self._send_lock:  # whatever was held back goes first
                try:
                    self._send_acks()
                except OSError:
                    pass
            self._reply(header, slot)(None, exc)
            return
        self._chunk(chunk_header, ciphertext, release=lambda: None, slot=slot)

    def open_ring(self, header: dict[str, Any], *, ready_rings: bool = False) -> None:
        """DATA_OPEN {session, ring: {epoch, slots, slot_bytes}}: a ring for this connection's window, its
        descriptor passed with the DATA_READY answer (SCM_RIGHTS). ``ready_rings``: the connection's first
        DATA_OPEN (its DATA_READY says rings are offered; a refused ring is then answered with a DATA_READY
        without one, and the agent sends in frames)."""
        try:
            if not self.rings:
                raise FrameError("shared-memory rings need the device's Unix socket and a connection opened "
                                 "with rings")
            request = DataOpen.from_wire(header)
            if request.session_id != self.session:
                raise StaleEpochError("ring request for another session")
            spec = request.ring
            if spec is None:  # e.g. "ring": null
                raise FrameError("a DATA_OPEN on an open data connection must name a ring")
            epoch = self.epoch
            if epoch is None or spec.epoch != epoch:
                raise StaleEpochError(f"this connection is admitted for epoch {epoch}, not {spec.epoch}")
            old = self.receiver.ring if self.receiver is not None else None
            if (old is None or not old.same_shape(spec)) and self.path.plane.rings_of(epoch) >= MAX_RINGS_PER_WINDOW:
                raise ProtocolError(f"window {epoch} already has {MAX_RINGS_PER_WINDOW} rings", code="budget")
            ring, new = self.path.intake.open_ring(spec, old)
        except ProtocolError as exc:
            self.path.counts.count_rejection(exc.code, self.epoch)
            if ready_rings:
                self.send(FrameType.DATA_READY, DataReady(self.session, rings=True).to_wire())
            else:
                self.send(FrameType.ERROR, {**error_header(exc), "ring": 1})
            return
        except OSError as exc:  # no memfd here after all: the agent falls back to frames
            if ready_rings:
                self.send(FrameType.DATA_READY, DataReady(self.session, rings=True).to_wire())
            else:
                self.send(FrameType.ERROR, {"ok": False, "code": "device", "reason": f"no ring: {exc}", "ring": 1})
            return
        answer = encode_frame(FrameType.DATA_READY, DataReady(self.session, rings=ready_rings or self.rings,
                                                              ring=spec, mapped=not new).to_wire())
        with self._send_lock:
            if new:  # the descriptor travels once per holder connection (again only for another shape)
                send_frame_with_fd(self.conn, answer, ring.fileno())
            else:
                self.conn.sendall(answer)
        if new and old is not None:
            self.path.plane.drop_ring(old)
        self.receiver = RingReceiver(ring)
        self._ack_batch = max(1, min(ACK_BATCH, spec.slots // 2))

    def deadmit(self) -> None:
        """Its window returned (``Admissions.close_window``): admitted for nothing until admitted again."""
        self.epoch = None

    def _readmit(self, header: dict[str, Any]) -> None:
        """DATA_OPEN {session, admit[, ring]} on an open connection: admitted for the holder's next window
        (and its ring bound to it: the one this connection maps, if of the same shape). Refused (anonymous
        unless the credential proves its window): ERROR with ``ring`` set, which fails the agent's hand-off."""
        path = self.path
        try:
            request = DataOpen.from_wire(header)
            if request.session_id != self.session or request.admit is None:
                raise AdmissionRefused(StaleEpochError("admission for another session"), None)
            path.plane.admissions.admit(path.windows, path.keys, request.admit, self.conn, self.deadmit, self.deliver)
        except FrameError as exc:
            path.counts.count_rejection(exc.code, self.epoch)
            self.send(FrameType.ERROR, {**error_header(exc), "ring": 1})
            return
        except AdmissionRefused as refused:
            if refused.charge is None:
                path.counts.count_refused("anonymous")
            else:
                path.counts.count_rejection(refused.error.code, refused.charge)
            self.send(FrameType.ERROR, {**error_header(refused.error), "ring": 1})
            return
        self.epoch = request.admit.epoch
        if request.ring is not None:
            self.open_ring(header)
        else:
            self.send(FrameType.DATA_READY, DataReady(self.session, rings=self.rings).to_wire())

    def close(self) -> None:
        """The connection ended: its ring is zeroed and unmapped."""
        if self.receiver is not None:
            self.path.plane.drop_ring(self.receiver.ring)
            self.receiver = None

    def _non_chunk(self, frame: Any) -> bool:
        """Handle a frame that is not a chunk; False ends the connection."""
        if frame.type is FrameType.PING:
            self.send(FrameType.PONG, frame.header)
            return True
        if frame.type is FrameType.BYE:
            return False
        # e.g. an attempt to read the buffer back: the data port only takes chunks in
        self.path.counts.count_rejection("frame", self.epoch)
        self.send(FrameType.ERROR, {"code": "frame", "reason": f"unexpected {frame.type.name}",
                                    "s": frame.header.get("s")})
        return True
