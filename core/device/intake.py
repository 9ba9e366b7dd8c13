"""The device's intake of provisioning chunks: each chunk checked against the open window (epoch, sequence,
offset, length, replay), then opened into the data buffer; refusals counted and charged to the window an
admitted connection speaks for, never to a holder when the connection is anonymous; the shared-memory rings
bound to the open window. Mixed into ``DeviceService``, which holds the window, the opener and the counters.
Where a chunk is decrypted: ``ChunkIntake.submit_chunk`` hands it to the service's ``ChunkOpener``
(``core/device/openers.py``): the host opener (through the data plane's slots) or the GPU opener."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gputravel.core.device.openers import ChunkOpener
from gputravel.core.errors import DeviceError, ProtocolError
from gputravel.core.protocol import (
    TAG_LEN,
    DirectionKey,
    FrameError,
    RecvState,
    ReplayError,
    StaleEpochError,
    WindowError,
)
from gputravel.core.protocol.shmring import RingSpec, ShmRing

__all__ = ["ChunkIntake", "ProvisionWindow"]


@dataclass(slots=True)
class ProvisionWindow:
    """The one open hand-off: which bytes of the buffer which key may write, in which epoch."""

    epoch: int
    offset: int
    length: int
    chunk_size: int
    fingerprint: str
    recv: RecvState
    accepted: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    bytes_in: int = 0
    contig: int = 0
    tags: set[bytes] = field(default_factory=set)  # GCM tags of the accepted chunks (public, not key material)
    key: DirectionKey | None = None  # for a chunk opener that needs the raw key (the GPU cipher)
    #: when the window opened (``perf_counter_ns``) and, in ns after it, its hand-off's first events: a data
    #: connection ``admitted``, a shared-memory ring ``ring_bound``, the ``first_chunk`` (and the ``last_chunk``)
    #: in device memory
    #: (``WindowClosed.marks_ns``: the hand-off's fixed cost by stage, ``handoff.fixed_stages``)
    opened_ns: int = field(default_factory=time.perf_counter_ns)
    marks: dict[str, int] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        """The first time ``name`` happens in this window (callers hold the service's lock)."""
        if name not in self.marks:
            self.marks[name] = time.perf_counter_ns() - self.opened_ns

    @property
    def n_chunks(self) -> int:
        return (self.length + self.chunk_size - 1) // self.chunk_size

    def contiguous(self) -> int:
        """Number of chunks accepted without a gap from the start (the resume point)."""
        while self.contig in self.accepted:
            self.contig += 1
        return self.contig


class ChunkIntake:
    """Mixed into ``DeviceService``: the data path's checks, decryption hand-off and rejection counts."""

    # supplied by DeviceService
    lock: Any
    window: ProvisionWindow | None
    opener: ChunkOpener
    plane: Any
    counters: Counter[str]
    refused: Counter[str]
    rejected: Counter[str]
    rejected_by_epoch: dict[int, Counter[str]]
    rejection_gen: int
    _epoch_gen: dict[int, int]
    _settled: threading.Condition
    dead_tags: dict[int, Any]
    dead_epochs: Any

    # --- data path ---------------------------------------------------------------------------
    def accept_chunk(self, header: dict[str, Any], payload: bytes | bytearray | memoryview, *,
                     charge: int | None = None) -> dict[str, Any]:
        """Authenticate and decrypt one chunk into the buffer window and return its ACK header once it is in
        device memory, or raise (counted). The synchronous form of ``submit_chunk``."""
        box: list[Any] = []
        settled = threading.Event()

        def reply(ack: dict[str, Any] | None, exc: BaseException | None) -> None:
            box.append(ack if exc is None else exc)
            settled.set()

        self.submit_chunk(header, payload, reply, charge=charge)
        settled.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]  # type: ignore[no-any-return]

    def submit_chunk(self, header: dict[str, Any], payload: bytes | bytearray | memoryview,
                     reply: Callable[[dict[str, Any] | None, BaseException | None], None], *,
                     charge: int | None = None) -> None:
        """Check one chunk against the open window, then open it into the buffer. ``reply(ack, None)`` is
        called once the chunk is in device memory, ``reply(None, error)`` if it is refused (counted), exactly
        once either way, maybe on another thread. Returns once ``payload`` is no longer read."""
        try:
            w, epoch, seq, offset, length, key = self._admit(header, payload)
        except ProtocolError as exc:
            self.count_rejection(exc.code, charge)
            reply(None, exc)
            return
        tag = bytes(payload[-TAG_LEN:])

        def done(exc: BaseException | None) -> None:
            ack: dict[str, Any] | None = None
            with self.lock:
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
                        w.mark("first_chunk")
                        w.marks["last_chunk"] = time.perf_counter_ns() - w.opened_ns
                        self.counters["chunks"] += 1
                        self.counters["bytes_in"] += length
                        ack = {"s": seq, "e": epoch, "contiguous": w.contiguous()}
                self._settled.notify_all()
            if exc is None:
                reply(ack, None)
                return
            if not isinstance(exc, ProtocolError):
                exc = DeviceError(f"opening chunk {seq} failed: {type(exc).__name__}: {exc}")
            else:
                self.count_rejection(exc.code, charge)
            reply(None, exc)

        # The one opener strategy (core/device/openers.py), outside the lock: chunks authenticate in parallel.
        self.opener.submit(w.recv, key, payload, seq=seq, offset=offset, length=length, chunk_size=w.chunk_size,
                           done=done)

    def count_refused(self, code: str) -> None:
        """A connection refused before it authenticated (a garbage first frame, a stall past the hand-shake
        timeout, one too many waiting, a session that does not exist): counted, attributed to no epoch."""
        with self.lock:
            self.refused[code] += 1

    def count_rejection(self, code: str, charge: Any = None) -> None:
        """Count a rejection, charged to epoch ``charge`` (the window an admitted data connection speaks for,
        so its holder) when given; else anonymous (``rejected_anonymous``): never blamed on a holder."""
        self.rejected[code] += 1
        epoch = charge if isinstance(charge, int) and not isinstance(charge, bool) else None
        if epoch is None:
            self.counters["rejected_anonymous"] += 1
            return
        self.rejected_by_epoch.setdefault(epoch, Counter())[code] += 1
        self.rejection_gen += 1
        self._epoch_gen.pop(epoch, None)  # re-inserted: the dict stays in change order
        self._epoch_gen[epoch] = self.rejection_gen

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
        with self.lock:
            w = self.window
            if w is None or epoch != w.epoch:
                if len(payload) >= TAG_LEN and bytes(payload[-TAG_LEN:]) in self.dead_tags.get(epoch, ()):
                    raise ReplayError(f"chunk {seq} of epoch {epoch} was accepted before: a captured chunk replayed")
                raise StaleEpochError(f"chunk for epoch {epoch}: no window is open for it"
                                      + (" (its key is dead)" if epoch in self.dead_epochs else ""))
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

    #: rings one epoch may have (an honest agent asks for one per hand-off, again after a dropped link)
    RINGS_PER_EPOCH = 4

    def open_ring(self, spec: RingSpec, current: ShmRing | None = None) -> tuple[ShmRing, bool]:
        """The shared-memory ring of the open window's holder (same host), bound to its epoch: ``current``
        (the ring of the holder's connection) when it has the asked shape, else a new one. Slots fit one
        chunk and its tag each. Refused (named) for any epoch but the open window's. Returns the ring and
        whether it is new (its descriptor must be sent)."""
        with self.lock:
            w = self.window
            if w is None or spec.epoch != w.epoch:
                raise StaleEpochError(f"ring for epoch {spec.epoch}: no window is open for it"
                                      + (" (its key is dead)" if spec.epoch in self.dead_epochs else ""))
            if spec.slot_bytes != w.chunk_size + TAG_LEN:
                raise FrameError(f"ring slots of {spec.slot_bytes} bytes: this window's chunks need "
                                 f"{w.chunk_size + TAG_LEN}")
            if self.plane.rings_of(spec.epoch) >= self.RINGS_PER_EPOCH:
                raise FrameError(f"epoch {spec.epoch} already has {self.RINGS_PER_EPOCH} rings")
            new = current is None or current.closed or not current.same_shape(spec)
            ring = ShmRing.create(spec) if new else current
            assert ring is not None
            self.plane.bind_ring(ring, spec.epoch)
            w.mark("ring_bound")
        self.counters["rings_bound"] += 1
        if new:
            self.counters["rings_made"] += 1
        return ring, new
