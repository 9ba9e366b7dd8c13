"""The device service's transport: a Unix socket, one thread per connection.

A connection is either the control channel (attestation, authenticated key exchange, then sealed
requests) or a data connection (ciphertext chunks in, acknowledgements out). The data path runs in
its own thread with no busy Python threads beside it, so AES-GCM (which releases the GIL) runs at
full speed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from gputravel.core.device.admission import MAX_RINGS_PER_WINDOW, AdmissionRefused
from gputravel.core.device.dataplane import SlotSet
from gputravel.core.device.pending import Budget as _Budget
from gputravel.core.device.pending import Deadlines as _Deadlines
from gputravel.core.device.pending import Pending as _Pending
from gputravel.core.device.service import MAX_CHUNK, DeviceService, Reply
from gputravel.core.errors import GpuTravelError, ProtocolError
from gputravel.core.protocol import TAG_LEN, FrameError, FrameType, StaleEpochError, encode_frame, read_frame
from gputravel.core.protocol.devicelink import (
    ControlChannel,
    error_header,
    send_frame,
    send_sealed,
    session_context,
)
from gputravel.core.protocol.frames import read_frame_into
from gputravel.core.protocol.holderlink import DataOpen, DataReady
from gputravel.core.protocol.shmring import RingReceiver, ring_supported, send_frame_with_fd

#: Connections that have not authenticated yet (no session opened, no DATA_READY), at most, per listener, and
#: how long one may take in all to get there (a deadline for the whole hand-shake, not a per-read timeout):
#: a peer that stalls, trickles or floods costs at most this many threads for this long, and only on the
#: listener it reached. The Unix socket (0600, in a 0700 folder) is the orchestrator's and its same-host
#: holders'; the TCP data port, which any local user can reach, has a budget of its own. A full budget
#: takes a newcomer in the place of its oldest connection only once that one has waited ``EVICT_AFTER_S``
#: (shut down, ``evicted``), and else refuses the newcomer (``full``): a flood never pushes out a connection
#: admitted in time whose first frame is read late under load, and strangers hold places for at most
#: ``EVICT_AFTER_S`` each once others wait (core/device/pending.py).
MAX_PENDING = 32
HANDSHAKE_TIMEOUT_S = 10.0
EVICT_AFTER_S = 2.0


class DeviceServer:
    def __init__(self, service: DeviceService, socket_path: str, *, data_host: str | None = "127.0.0.1",
                 data_port: int = 0, max_pending: int = MAX_PENDING,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, evict_after: float | None = None) -> None:
        self.service = service
        self.socket_path = socket_path
        self.data_host = data_host
        self.data_port = data_port
        self.tcp: socket.socket | None = None
        self._stop = threading.Event()
        self._control_busy = threading.Lock()
        self.sock: socket.socket | None = None
        self.handshake_timeout = handshake_timeout
        # one budget per listener: strangers on the TCP port never take the places of the Unix socket's peers
        # a place is safe from newcomers for ``evict_after`` (EVICT_AFTER_S; half the deadline where that is less)
        if evict_after is None:
            evict_after = min(EVICT_AFTER_S, handshake_timeout / 2)
        self._pending_unix = _Budget(max_pending, evict_after)
        self._pending_tcp = _Budget(max_pending, evict_after)
        self._deadlines = _Deadlines()

    def _admit(self, conn: socket.socket, *, data_only: bool) -> None:
        """A thread for a new connection, in its listener's budget of ``max_pending`` unauthenticated ones
        (when full, the oldest one gives up its place, counted ``evicted``, if it has waited ``evict_after``;
        else the newcomer is refused at once, counted ``full``, with an ERROR frame that says so)."""
        pending = (self._pending_tcp if data_only else self._pending_unix).enter(conn)
        if pending is None:
            self.service.counts.count_refused("full")
            conn.settimeout(0.1)  # a fresh socket's send buffer is empty: the short ERROR frame never waits
            with contextlib.suppress(OSError):
                send_frame(conn, FrameType.ERROR, {"code": "busy", "reason": "every place for a connection "
                                                   "not yet admitted is taken: try again"})
            conn.close()
            return
        conn.settimeout(self.handshake_timeout)
        self._deadlines.add(pending, self.handshake_timeout)
        threading.Thread(target=self._handle, args=(conn, pending), kwargs={"data_only": data_only},
                         daemon=True).start()

    def serve_forever(self) -> None:
        self._deadlines.start()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.socket_path)
        finally:
            os.umask(old)
        self.sock.listen(64)
        ready = f"READY {self.socket_path}"
        if self.data_host:
            # The data port (the direct path): data connections only; sealed chunks need no further protection.
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((self.data_host, self.data_port))
            self.tcp.listen(64)
            ready += f" {self.tcp.getsockname()[1]}"
            threading.Thread(target=self._accept_data, daemon=True).start()
        print(ready, flush=True)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    break
                self._admit(conn, data_only=False)
        finally:
            self.close()

    def _accept_data(self) -> None:
        while not self._stop.is_set() and self.tcp is not None:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._admit(conn, data_only=True)

    def close(self) -> None:
        self._stop.set()
        if self.tcp is not None:
            try:
                self.tcp.close()
            finally:
                self.tcp = None
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                with contextlib.suppress(FileNotFoundError):  # a second close (the signal handler's) got there first
                    os.unlink(self.socket_path)

    def _handle(self, conn: socket.socket, pending: _Pending, *, data_only: bool = False) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # small buffer: a large payload read bypasses it and lands straight in the slot
        stream: Any = conn.makefile("rb", buffering=1 << 16)
        svc = self.service

        def refuse(code: str, reason: str) -> None:
            svc.counts.count_refused(code)
            send_frame(conn, FrameType.ERROR, {"code": code, "reason": reason})

        try:
            first = read_frame(stream)
            if first is None:
                if pending.expired:
                    svc.counts.count_refused(pending.reason)
                return
            if first.type is FrameType.ATTEST_REQUEST and data_only:
                refuse("frame", "the data port takes data connections only")
            elif first.type is FrameType.ATTEST_REQUEST:
                if not self._control_busy.acquire(blocking=False):
                    svc.counts.count_refused("busy")
                    send_frame(conn, FrameType.ERROR, {"code": "device", "reason": "a control session is active"})
                    return
                try:
                    self._control(conn, stream, first, pending)
                finally:
                    self._control_busy.release()
            elif first.type is FrameType.DATA_OPEN:
                self._data(conn, stream, first, pending)
            elif first.type is FrameType.PING and first.header.get("counters") and not data_only:
                send_frame(conn, FrameType.PONG, svc.public_counters())
            else:
                refuse("frame", f"unexpected {first.type.name}")
        except TimeoutError:  # stalled before authenticating: its thread and place are given back
            if not pending.released or pending.expired:
                svc.counts.count_refused(pending.reason)
        except (OSError, ConnectionError):
            if pending.expired:
                svc.counts.count_refused(pending.reason)
        except GpuTravelError as exc:
            if pending.expired:
                svc.counts.count_refused(pending.reason)
            elif not pending.released:  # e.g. garbage as a first frame: counted like every rejection
                svc.counts.count_refused(exc.code)
            try:
                send_frame(conn, FrameType.ERROR, error_header(exc))
            except OSError:
                pass
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # a malformed handshake message
            svc.counts.rejected["frame"] += 1
            try:
                send_frame(conn, FrameType.ERROR, {"ok": False, "code": "frame", "reason": f"malformed message: {exc}"})
            except OSError:
                pass
        finally:
            pending.end()
            stream.close()
            conn.close()

    # --- control -------------------------------------------------------------------------
    def _control(self, conn: socket.socket, stream: Any, first: Any, pending: _Pending) -> None:
        svc = self.service
        nonce = bytes.fromhex(str(first.header.get("nonce", "")))
        evidence = svc.evidence(nonce)
        send_frame(conn, FrameType.EVIDENCE, {"evidence": evidence.to_dict()})
        kex = read_frame(stream)
        if kex is None or kex.type is not FrameType.KEX_INIT:
            raise FrameError("expected KEX_INIT")
        pub, sig, secrets = svc.open_session(initiator_public=bytes.fromhex(kex.header["public"]),
                                             context=session_context(nonce, evidence.digest()))
        send_frame(conn, FrameType.KEX_REPLY, {"public": pub.hex(), "signature": sig.hex()})
        pending.authenticated()  # the session is open: no hand-shake time limit from here on
        chan = ControlChannel.for_device(secrets, 0)
        while True:
            frame = read_frame(stream)
            if frame is None:
                return
            if frame.type is not FrameType.SEALED:
                raise FrameError(f"expected SEALED, got {frame.type.name}")
            inner = chan.open(frame.header, frame.payload)
            reply: Reply | None = None
            try:
                reply = svc.handle(str(inner.header.get("op", "")), dict(inner.header.get("args", {})),
                                   bytes(inner.payload))
                head, ct = chan.seal(FrameType.RESPONSE, {"ok": True, **reply.header}, reply.payload,
                                     attached=reply.attached)
            except Exception as exc:  # the device reports, never dies, on a bad request (error_header types it)
                reply = None
                head, ct = chan.seal(FrameType.RESPONSE, error_header(exc), b"")
            send_sealed(conn, head, ct, reply.payload if reply is not None and reply.attached else b"")
            if reply is not None and reply.rekey_to is not None:
                chan = ControlChannel.for_device(secrets, reply.rekey_to)
            if reply is not None and reply.stop:
                self.close()
                return

    # --- data ----------------------------------------------------------------------------
    def _data(self, conn: socket.socket, stream: Any, first: Any, pending: _Pending) -> None:
        """A data connection: admitted for one holder's window by its first DATA_OPEN (``Admission``), or
        refused and counted as anonymous (core/device/admission.py)."""
        svc = self.service
        secrets = svc.secrets
        opening = DataOpen.from_wire(first.header)  # malformed: FrameError, refused and counted by _handle
        if secrets is None or opening.session_id != secrets.session_id.hex():
            svc.counts.count_refused("stale-epoch")
            send_frame(conn, FrameType.ERROR, {"code": "stale-epoch", "reason": "no such session"})
            return
        session = secrets.session_id.hex()
        if opening.admit is None:
            svc.counts.count_refused("anonymous")
            send_frame(conn, FrameType.ERROR, {"code": "admission",
                                               "reason": "a data connection must be admitted for a window"})
            return
        # shared-memory rings only where the holder shares this host: on the Unix socket, when asked for
        rings = conn.family == socket.AF_UNIX and ring_supported() and opening.rings
        slots = svc.plane.take_slots()  # this connection's receive buffers, reused from an earlier one
        data = _DataConnection(svc, conn, stream, slots, session=session, rings=rings)
        try:
            try:
                svc.plane.admissions.admit(svc.windows, svc.keys, opening.admit, conn, data.deadmit)
            except AdmissionRefused as refused:
                if refused.charge is None:
                    svc.counts.count_refused("anonymous")
                else:
                    svc.counts.count_rejection(refused.error.code, refused.charge)
                send_frame(conn, FrameType.ERROR, error_header(refused.error))
                return
            data.epoch = opening.admit.epoch
            pending.authenticated()  # admitted: it speaks for this (holder, epoch) until RETURN
            if opening.ring is not None and rings:  # the first ring rides with the admission: one round trip
                data._open_ring(first.header, ready_rings=True)
            else:
                send_frame(conn, FrameType.DATA_READY, DataReady(session, rings=rings).to_wire())
            data.serve()
        finally:
            svc.plane.admissions.leave(conn)
            data.close()
            svc.plane.give_slots(slots)


#: Most acknowledgements one data connection holds back before it sends them in one frame (on a ring, at
#: most half its slots, so the agent always has slots to seal into while the other half is acknowledged).
ACK_BATCH = 4


class _DataConnection:
    """One data connection: sealed chunks in (in frames, or as slot ids of a shared-memory ring), ACK and
    ERROR out. This thread keeps receiving while the service's decrypt workers (if any) open earlier
    chunks; acknowledgements go out as chunks reach device memory, in any order."""

    def __init__(self, svc: DeviceService, conn: socket.socket, stream: Any, slots: SlotSet, *, session: str,
                 rings: bool) -> None:
        self.svc, self.conn, self.stream, self.slots = svc, conn, stream, slots
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

    def serve(self) -> None:
        svc = self.svc
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(self.slots)):
            free.put(i)
        while True:
            i = free.get()  # blocks while every buffer's chunk is still being opened: back-pressure
            try:
                frame = read_frame_into(self.stream, functools.partial(self.slots.get, i),
                                        max_payload=MAX_CHUNK + TAG_LEN)
            except FrameError as exc:
                svc.counts.count_rejection(exc.code, self.epoch)
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
                self._open_ring(header)
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
        head: dict[str, Any] = {"batch": [s for s, _ in acks], "e": self._ack_epoch,
                                "contiguous": self._ack_contiguous}
        if acks[0][1] is not None:
            head["slots"] = [k for _, k in acks]
        send_frame(self.conn, FrameType.ACK, head)

    def _chunk(self, header: Any, payload: Any, *, release: Callable[[], None], slot: Any) -> None:
        if isinstance(header, dict) and "f" in header:  # this agent takes batched acknowledgements
            flush = header.pop("f") == 1
            reply = self._batched_reply(header, slot, flush)
        else:
            reply = self._reply(header, slot)
        claimed = header.get("e") if isinstance(header, dict) else None
        w = self.svc.windows.window
        if type(claimed) is int and claimed != self.epoch and w is not None and claimed == w.epoch:
            # another holder's open window: never written through this connection (charged to its own)
            self.svc.counts.count_rejection("stale-epoch", self.epoch)
            release()
            reply(None, StaleEpochError(f"this connection is admitted for epoch {self.epoch}, not {claimed}"))
            return

        def work() -> None:
            try:
                self.svc.intake.submit_chunk(header, payload, reply, charge=self.epoch)
            finally:
                release()

        plane = self.svc.plane
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
            self.svc.counts.count_rejection(exc.code, self.epoch)
            with self._send_lock:  # whatever was held back goes first
                try:
                    self._send_acks()
                except OSError:
                    pass
            self._reply(header, slot)(None, exc)
            return
        self._chunk(chunk_header, ciphertext, release=lambda: None, slot=slot)

    def _open_ring(self, header: dict[str, Any], *, ready_rings: bool = False) -> None:
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
            if (old is None or not old.same_shape(spec)) and self.svc.plane.rings_of(epoch) >= MAX_RINGS_PER_WINDOW:
                raise ProtocolError(f"window {epoch} already has {MAX_RINGS_PER_WINDOW} rings", code="budget")
            ring, new = self.svc.intake.open_ring(spec, old)
        except ProtocolError as exc:
            self.svc.counts.count_rejection(exc.code, self.epoch)
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
            self.svc.plane.drop_ring(old)
        self.receiver = RingReceiver(ring)
        self._ack_batch = max(1, min(ACK_BATCH, spec.slots // 2))

    def deadmit(self) -> None:
        """Its window returned (``Admissions.close_window``): admitted for nothing until admitted again."""
        self.epoch = None

    def _readmit(self, header: dict[str, Any]) -> None:
        """DATA_OPEN {session, admit[, ring]} on an open connection: admitted for the holder's next window
        (and its ring bound to it: the one this connection maps, if of the same shape). Refused (anonymous
        unless the credential proves its window): ERROR with ``ring`` set, which fails the agent's hand-off."""
        svc = self.svc
        try:
            request = DataOpen.from_wire(header)
            if request.session_id != self.session or request.admit is None:
                raise AdmissionRefused(StaleEpochError("admission for another session"), None)
            svc.plane.admissions.admit(svc.windows, svc.keys, request.admit, self.conn, self.deadmit)
        except FrameError as exc:
            svc.counts.count_rejection(exc.code, self.epoch)
            self.send(FrameType.ERROR, {**error_header(exc), "ring": 1})
            return
        except AdmissionRefused as refused:
            if refused.charge is None:
                svc.counts.count_refused("anonymous")
            else:
                svc.counts.count_rejection(refused.error.code, refused.charge)
            self.send(FrameType.ERROR, {**error_header(refused.error), "ring": 1})
            return
        self.epoch = request.admit.epoch
        if request.ring is not None:
            self._open_ring(header)
        else:
            self.send(FrameType.DATA_READY, DataReady(self.session, rings=self.rings).to_wire())

    def close(self) -> None:
        """The connection ended: its ring is zeroed and unmapped."""
        if self.receiver is not None:
            self.svc.plane.drop_ring(self.receiver.ring)
            self.receiver = None

    def _non_chunk(self, frame: Any) -> bool:
        """Handle a frame that is not a chunk; False ends the connection."""
        if frame.type is FrameType.PING:
            self.send(FrameType.PONG, frame.header)
            return True
        if frame.type is FrameType.BYE:
            return False
        # e.g. an attempt to read the buffer back: the data port only takes chunks in
        self.svc.counts.count_rejection("frame", self.epoch)
        self.send(FrameType.ERROR, {"code": "frame", "reason": f"unexpected {frame.type.name}",
                                    "s": frame.header.get("s")})
        return True
