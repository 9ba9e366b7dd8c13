"""The device's intake of provisioning chunks: each chunk checked against the open window (epoch, sequence,
offset, length, replay), then opened into the data buffer; refusals counted and charged to the window an
admitted connection speaks for, never to a holder when the connection is anonymous; the shared-memory rings
bound to the open window.

:class:`ChunkIntake` is one part of :class:`~gputravel.core.device.service.DeviceService`; it owns no window of its
own: it reads the windows part's open window under its lock (:mod:`gputravel.core.device.window`) and counts
into the counts part. It adds no operation to the table: the transport (core/device/server.py) calls
``submit_chunk`` and ``open_ring``. Where a chunk is decrypted: ``submit_chunk`` hands it to the service's
``ChunkOpener`` (``core/device/openers.py``): the host opener (through the data plane's slots) or the GPU
opener."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gputravel.core.device.counters import Counters
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.openers import ChunkOpener
from gputravel.core.device.window import BufferWindows, ProvisionWindow
from gputravel.core.errors import DeviceError, ProtocolError
from gputravel.core.protocol import (
    TAG_LEN,
    DirectionKey,
    FrameError,
    ReplayError,
    StaleEpochError,
    WindowError,
)
from gputravel.core.protocol.shmring import RingSpec, ShmRing

__all__ = ["ChunkIntake"]


class ChunkIntake:
    """The data path's checks, decryption hand-off and rejection counts. Given at construction: the windows part
    (the open window, its lock and in-flight condition, the dead epochs and tags), the counts, the opener and
    the data plane (its rings)."""

    #: rings one epoch may have (an honest agent asks for one per hand-off, again after a dropped link)
    RINGS_PER_EPOCH = 4

    def __init__(self, *, windows: BufferWindows, counts: Counters, opener: ChunkOpener, plane: DataPlane) -> None:
        self._windows, self._counts, self._opener, self._plane = windows, counts, opener, plane

    # --- data path ---------------------------------------------------------------------------
    def accept_chunk(self, header: dict[str, Any], payload: bytes | bytearray | memoryview, *,
                     charge: int | None = None) -> dict[str, Any]:
        """Authenticate and decrypt one chunk into the buffer window and return its ACK header once it is in
        device memory, or raise (counted). The synchronous form of ``submit_chunk``."""
        box: list[dict[str, Any] | BaseException] = []
        settled = threading.Event()

        def reply(ack: dict[str, Any] | None, exc: BaseException | None) -> None:
            box.append(exc if exc is not None else ack if ack is not None else {})
            settled.set()

        self.submit_chunk(header, payload, reply, charge=charge)
        settled.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def submit_chunk(self, header: dict[str, Any], payload: bytes | bytearray | memoryview,
                     reply: Callable[[dict[str, Any] | None, BaseException | None], None], *,
                     charge: int | None = None) -> None:
        """Check one chunk against the open window, then open it into the buffer. ``reply(ack, None)`` is
        called once the chunk is in device memory, ``reply(None, error)`` if it is refused (counted), exactly
        once either way, maybe on another thread. Returns once ``payload`` is no longer read."""
        try:
            w, epoch, seq, offset, length, key = self._admit(header, payload)
        except ProtocolError as exc:
            self._counts.count_rejection(exc.code, charge)
            reply(None, exc)
            return
        tag = bytes(payload[-TAG_LEN:])

        def done(exc: BaseException | None) -> None:
            ack: dict[str, Any] | None = None
            with self._windows.lock:
                w.inflight.discard(seq)
                if exc is None:
                    try:
                        w.recv.window.accept(seq)
                    except ProtocolError as late:  # the window moved past it while it was being opened
                        exc = late
                    else:
                        w.accepted.add(seq)
                        w.tags.add(tag)
                        w.bytes_in += length
                        marks = w.marks
                        marks["last_chunk"] = time.perf_counter_ns() - w.opened_ns
                        if "first_chunk" not in marks:
                            marks["first_chunk"] = marks["last_chunk"]
                        counters = self._counts.counters
                        counters["chunks"] += 1
                        counters["bytes_in"] += length
                        ack = {"s": seq, "e": epoch, "contiguous": w.contiguous()}
                if not w.inflight:  # the one waiter (``close_window``) waits for an empty in-flight set
                    self._windows.settled.notify_all()
                    if exc is None and len(w.accepted) == w.n_chunks:  # complete: a held request wakes, once
                        self._windows.completed.notify_all()
            if exc is None:
                reply(ack, None)
                return
            if not isinstance(exc, ProtocolError):
                exc = DeviceError(f"opening chunk {seq} failed: {type(exc).__name__}: {exc}")
            else:
                self._counts.count_rejection(exc.code, charge)
            reply(None, exc)

        # The one opener strategy (core/device/openers.py), outside the lock: chunks authenticate in parallel.
        self._opener.submit(w.recv, key, payload, seq=seq, offset=offset, length=length, chunk_size=w.chunk_size,
                           done=done)

    def _admit(self, header: dict[str, Any], payload: bytes | bytearray | memoryview
               ) -> tuple[ProvisionWindow, int, int, int, int, DirectionKey | None]:
        """Every check before decryption; reserves the sequence number (``inflight``) on success."""
        fields: list[int] = []
        for name in ("e", "s", "o", "n"):
            value = header.get(name) if isinstance(header, dict) else None
            if type(value) is not int:  # not bool, float, numeric string or JSON Infinity
                raise FrameError("chunk header needs integer e, s, o, n")
            fields.append(value)
        epoch, seq, offset, length = fields
        with self._windows.lock:
            w = self._windows.window
            if w is None or epoch != w.epoch:
                if len(payload) >= TAG_LEN and bytes(payload[-TAG_LEN:]) in self._windows.dead_tags.get(epoch, ()):
                    raise ReplayError(f"chunk {seq} of epoch {epoch} was accepted before: a captured chunk replayed")
                raise StaleEpochError(f"chunk for epoch {epoch}: no window is open for it"
                                      + (" (its key is dead)" if epoch in self._windows.dead_epochs else ""))
            if seq < 0 or length <= 0 or offset < w.offset or offset + length > w.offset + w.length:
                raise WindowError(f"chunk [{offset}, {offset + length}) is outside the window "
                                  f"[{w.offset}, {w.offset + w.length})")
            want_off = w.offset + seq * w.chunk_size
            want_len = min(w.chunk_size, w.offset + w.length - want_off)
            if offset != want_off or length != want_len:
                raise WindowError(f"chunk {seq} must cover [{want_off}, {want_off + want_len}), "
                                  f"not [{offset}, {offset + length})")
            if len(payload) != length + TAG_LEN:
                raise FrameError(f"chunk {seq} carries {len(payload)} bytes, expected {length + TAG_LEN}")
            if seq in w.inflight:
                raise ReplayError(f"sequence {seq} is already being authenticated")
            w.recv.precheck(seq=seq, epoch=epoch)
            w.inflight.add(seq)  # reserved: a duplicate cannot race this one into the same bytes
            key = w.key  # taken with the window live (burying it drops the key)
        return w, epoch, seq, offset, length, key

    def open_ring(self, spec: RingSpec, current: ShmRing | None = None) -> tuple[ShmRing, bool]:
        """The shared-memory ring of the open window's holder (same host), bound to its epoch: ``current``
        (the ring of the holder's connection) when it has the asked shape, else a new one. Slots fit one
        chunk and its tag each. Refused (named) for any epoch but the open window's. Returns the ring and
        whether it is new (its descriptor must be sent)."""
        with self._windows.lock:
            w = self._windows.window
            if w is None or spec.epoch != w.epoch:
                raise StaleEpochError(f"ring for epoch {spec.epoch}: no window is open for it"
                                      + (" (its key is dead)" if spec.epoch in self._windows.dead_epochs else ""))
            if spec.slot_bytes != w.chunk_size + TAG_LEN:
                raise FrameError(f"ring slots of {spec.slot_bytes} bytes: this window's chunks need "
                                 f"{w.chunk_size + TAG_LEN}")
            if self._plane.rings_of(spec.epoch) >= self.RINGS_PER_EPOCH:
                raise FrameError(f"epoch {spec.epoch} already has {self.RINGS_PER_EPOCH} rings")
            new = current is None or current.closed or not current.same_shape(spec)
            ring = ShmRing.create(spec) if new else current
            assert ring is not None
            self._plane.bind_ring(ring, spec.epoch)
            w.mark("ring_bound")
        self._counts.counters["rings_bound"] += 1
        if new:
            self._counts.counters["rings_made"] += 1
        return ring, new
