"""The device's provisioning machinery: allocated once per device service, reused by every hand-off.

What a chunk costs here is the AES-GCM work plus at most one memory copy; nothing is allocated per
chunk or per hand-off:

- receive slots (the socket path): sets of payload buffers, one set per data connection, taken from a
  free list when the connection opens and given back when it closes; a set is grown to the largest
  chunk once, so a holder's long-lived connection keeps its buffers across hand-offs;
- decrypt workers: one thread pool for the service's life (``configure``), 0 (decrypt on the receiving
  thread), or 2-4 threads where there are cores for them (chosen by measurement, see ``default_workers``);
- shared-memory rings (same-host holders): one per holder data connection, bound to the epoch of each
  hand-off (``bind_ring``), zeroed and released when its window closes (``release_rings``, RETURN),
  unmapped when the connection ends (``drop_ring``); at RETURN (``close_window``) the window's connections
  are admitted for nothing until admitted again for their holder's next window (core/device/admission.py);
- staging (CUDA, or on request for tests on CPU): a ring of pinned host slots and one copy stream. A
  chunk is opened into a free slot, copied with ``copy_(non_blocking=True)`` and an ``Event`` recorded
  after it; a completion thread waits for the events in order, frees each slot and only then reports the
  chunk done (acknowledged), so an ACK means the bytes are in device memory. ``flush`` (closing a window)
  waits for every copy; ``make_current_wait`` makes the training stream wait for the copy stream.

This is the machinery of the host opener (``openers.HostOpener``: the host CPU authenticates and decrypts,
into the buffer or a staging slot); the GPU opener (``openers.GpuOpener``) takes the ciphertext into device
memory as it is and needs none of it but the rings and admissions.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gputravel.core.device.admission import Admissions
from gputravel.core.procs import name_os_thread
from gputravel.core.protocol import FrameType, RecvState
from gputravel.core.protocol.shmring import ShmRing

#: Called exactly once per chunk: None once its plaintext is in device memory, else the error.
DoneFn = Callable[[BaseException | None], None]

__all__ = ["DataPlane", "DoneFn", "SlotSet", "default_workers"]

#: Below this many cores the receiving thread decrypts itself (0 workers): measured on the 2-core build
#: machines, a worker thread only added hand-offs between threads while the holder's agent keeps the
#: other core busy sealing. From 4 cores: 2 workers, from 8: 4 (the issue's scaling target), never more.
AUTO_MIN_CORES = 4


def default_workers(cores: int | None = None) -> int:
    """Decrypt workers by cores: 0 below 4 cores, 2 from 4, 4 from 8 (see docs/provisioning.md)."""
    cores = cores or os.cpu_count() or 2
    if cores < AUTO_MIN_CORES:
        return 0
    return 4 if cores >= 8 else 2


class SlotSet:
    """The receive buffers of one data connection (reused by the next connection once it closes)."""

    __slots__ = ("bufs",)

    def __init__(self, n: int) -> None:
        self.bufs = [bytearray() for _ in range(n)]

    def get(self, i: int, n: int) -> bytearray:
        """Buffer ``i``, grown (once) to at least ``n`` bytes."""
        if len(self.bufs[i]) < n:
            self.bufs[i] = bytearray(n)
        return self.bufs[i]

    def __len__(self) -> int:
        return len(self.bufs)


def _decrypt(recv: RecvState, ciphertext: Any, dest: Any, *, seq: int, offset: int, length: int) -> None:
    """The host CPU opens one chunk into ``dest`` (AES-GCM ``decrypt_into``, the GIL released); a bad tag
    raises ``TagError`` with ``dest`` zeroed."""
    recv.decrypt_into(ciphertext, dest, seq=seq, frame_type=FrameType.CHUNK, offset=offset, length=length)


class _CopyEngine:
    """Host-to-device copies. The CPU stand-in copies at once; its 'event' is None (already complete)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def make_current_wait(self) -> None:
        return None


class _CudaCopyEngine(_CopyEngine):
    """One copy stream; each copy ends with an ``Event`` recorded on it (one event per staging slot)."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.events = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]
        self._slot = 0

    def copy_slot(self, k: int, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = self.events[k]
            ev.record(self.stream)
        return ev

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def make_current_wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _Staging:
    """A ring of host staging slots (pinned on CUDA) with a completion thread."""

    def __init__(self, buffer: torch.Tensor, *, slots: int, slot_bytes: int,
                 add_ns: Callable[[str, int], None]) -> None:
        self.buffer = buffer
        self.cuda = buffer.device.type == "cuda"
        self.slot_bytes = slot_bytes
        pin = self.cuda
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.host = [s.numpy() for s in self.slots]
        self.engine: _CopyEngine = _CudaCopyEngine(buffer.device, slots) if self.cuda else _CopyEngine()
        self.add_ns = add_ns
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for k in range(slots):
            self.free.put(k)
        self._enqueue = threading.Lock()
        self._completions: queue.SimpleQueue[tuple[int, Any, DoneFn, int] | None] = queue.SimpleQueue()
        self._outstanding = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._complete, name="device-h2d-complete", daemon=True)
        self._thread.start()

    def open(self, recv: RecvState, payload: Any, *, seq: int, offset: int, length: int, done: DoneFn) -> None:
        """Open into a free slot and queue its copy; returns once ``payload`` is no longer read."""
        t0 = time.perf_counter_ns()
        k = self.free.get()  # blocks while every slot's copy is in flight: back-pressure, no allocation
        t1 = time.perf_counter_ns()
        try:
            _decrypt(recv, payload, self.host[k][:length], seq=seq, offset=offset, length=length)
        except BaseException as exc:
            self.free.put(k)
            done(exc)
            return
        t2 = time.perf_counter_ns()
        with self._idle:
            self._outstanding += 1
        with self._enqueue:  # copy and its event back to back on the one copy stream, in submission order
            dst = self.buffer[offset: offset + length]
            src = self.slots[k][:length]
            if isinstance(self.engine, _CudaCopyEngine):
                ev = self.engine.copy_slot(k, dst, src)
            else:
                ev = self.engine.copy(dst, src)
            self._completions.put((k, ev, done, time.perf_counter_ns()))
        self.add_ns("staging_wait_ns", t1 - t0)
        self.add_ns("open_ns", t2 - t1)

    def _complete(self) -> None:
        name_os_thread()
        while True:
            item = self._completions.get()
            if item is None:
                return
            k, ev, done, t_enq = item
            try:
                self.engine.wait(ev)
                err: BaseException | None = None
            except BaseException as exc:  # a failed copy fails its chunk (and is reported)
                err = exc
            self.add_ns("h2d_ns", time.perf_counter_ns() - t_enq)
            self.free.put(k)
            try:
                done(err)
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued copy reached device memory and was reported; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        self.engine.synchronize()
        return True

    def zero(self) -> None:
        for s in self.slots:
            s.zero_()

    def close(self) -> None:
        self.flush()
        self._completions.put(None)
        self._thread.join(timeout=5)
        self.zero()


class DataPlane:
    """One per device service: everything the data path reuses across chunks and hand-offs."""

    def __init__(self, buffer: torch.Tensor, *, staged: bool | None = None,
                 stage_ns: Counter[str] | None = None) -> None:
        """``stage_ns``: where nanoseconds per stage are summed (``open_ns``, ``staging_wait_ns``, ``h2d_ns``)
        and allocations counted (``alloc_*``); the service passes its public counters (``stats``)."""
        self.buffer = buffer
        self.staged = buffer.device.type == "cuda" if staged is None else bool(staged)
        self._host_view = buffer.numpy() if buffer.device.type == "cpu" else None
        self.workers = 0
        self.pool: ThreadPoolExecutor | None = None
        #: where a chunk that came in a socket frame is opened when there are no decrypt workers (``pool``
        #: None) but receiving is overlapped with decryption (``configure(frame_overlap=True)``): one
        #: long-lived thread, so the connection's thread receives the next frame meanwhile (ring chunks have
        #: nothing to receive and are opened inline)
        self.frame_pool: ThreadPoolExecutor | None = None
        self.per_set = 4
        self._sets: list[SlotSet] = []
        self._sets_lock = threading.Lock()
        self.stage_ns: Counter[str] = Counter() if stage_ns is None else stage_ns
        #: what was allocated, and how often (``alloc_*``: in the service's counters too, so ``stats`` shows
        #: that nothing is allocated per chunk or per hand-off)
        self.allocations = self.stage_ns
        self._stats_lock = threading.Lock()
        self._staging: _Staging | None = None
        self._staging_lock = threading.Lock()
        self.rings: dict[int, list[ShmRing]] = {}
        self._rings_lock = threading.Lock()
        #: the data connections admitted per holder window (core/device/admission.py)
        self.admissions = Admissions()

    def add_ns(self, stage: str, ns: int) -> None:
        with self._stats_lock:  # workers and the completion thread add at once
            self.stage_ns[stage] += ns

    # --- workers and receive slots ---------------------------------------------------------------
    def configure(self, *, workers: int, frame_overlap: bool = False) -> None:
        """Set the decrypt workers (0: the receiving thread decrypts) and, without workers, whether chunks
        that come in socket frames are opened on one decrypt thread while the next frame is received
        (``frame_overlap``; chunks on a shared-memory ring are then still opened inline). The pools live
        until changed."""
        workers = max(0, int(workers))
        frame_overlap = bool(frame_overlap) and not workers
        if (workers == self.workers and (self.pool is not None) == (workers > 0)
                and (self.frame_pool is not None) == frame_overlap):
            return
        old, self.pool = self.pool, None
        if old is not None:
            old.shutdown(wait=True)
        old, self.frame_pool = self.frame_pool, None
        if old is not None:
            old.shutdown(wait=True)
        self.workers = workers
        if workers:
            self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="device-open",
                                           initializer=name_os_thread)
            self.allocations["alloc_pool"] += 1
        elif frame_overlap:
            self.frame_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-frame-open",
                                                 initializer=name_os_thread)
            self.allocations["alloc_pool"] += 1
        self.per_set = 2 * workers + 2 if workers else (4 if frame_overlap else 2)

    def take_slots(self) -> SlotSet:
        """A receive slot set for a new data connection (a free one if any: sets are reused)."""
        with self._sets_lock:
            for i, s in enumerate(self._sets):
                if len(s) >= self.per_set:
                    return self._sets.pop(i)
        self.allocations["alloc_slot_sets"] += 1
        return SlotSet(self.per_set)

    def give_slots(self, slots: SlotSet) -> None:
        with self._sets_lock:
            if len(self._sets) < 8:
                self._sets.append(slots)

    # --- opening --------------------------------------------------------------------------------
    def _staging_for(self, chunk_size: int) -> _Staging:
        st = self._staging
        if st is not None and st.slot_bytes >= chunk_size:
            return st
        with self._staging_lock:
            st = self._staging
            if st is None or st.slot_bytes < chunk_size:  # first chunk, or a larger chunk size than ever before
                if st is not None:
                    st.close()
                slots = max(4, 2 * max(1, self.workers) + 2)
                st = self._staging = _Staging(self.buffer, slots=slots, slot_bytes=chunk_size, add_ns=self.add_ns)
                self.allocations["alloc_staging"] += 1
            return st

    def open(self, recv: RecvState, payload: Any, *, seq: int, offset: int, length: int, chunk_size: int,
             done: DoneFn) -> None:
        """The host opener's path: open one admitted chunk into ``buffer[offset:offset+length]``; ``done`` is
        called once it is in device memory (or failed). Returns once ``payload`` is no longer read."""
        if not self.staged and self._host_view is not None:
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                _decrypt(recv, payload, self._host_view[offset: offset + length], seq=seq, offset=offset,
                         length=length)
            except BaseException as exc:
                done(exc)
                return
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            with self._stats_lock:  # wall and CPU time in the open (``open_cpu_ns``: what ``bench provision`` accounts)
                self.stage_ns["open_ns"] += t1 - t0
                self.stage_ns["open_cpu_ns"] += c1 - c0
            done(None)
            return
        self._staging_for(chunk_size).open(recv, payload, seq=seq, offset=offset, length=length, done=done)

    def flush(self) -> bool:
        """Every opened chunk is in device memory and reported (closing a window waits for this)."""
        st = self._staging
        return True if st is None else st.flush()

    def make_current_wait(self) -> None:
        """Training's stream waits for the copy stream (CUDA); nothing to wait for on the CPU."""
        st = self._staging
        if st is not None:
            st.engine.make_current_wait()

    # --- shared-memory rings --------------------------------------------------------------------
    def bind_ring(self, ring: ShmRing, epoch: int) -> None:
        """``ring`` serves the hand-off of ``epoch`` until ``release_rings(epoch)``."""
        ring.bind(epoch)
        with self._rings_lock:
            self.rings.setdefault(epoch, []).append(ring)

    def rings_of(self, epoch: int) -> int:
        with self._rings_lock:
            return len(self.rings.get(epoch, ()))

    def release_rings(self, epoch: int | None = None) -> int:
        """RETURN: zero and unbind the rings of ``epoch`` (every ring when None); how many."""
        with self._rings_lock:
            epochs = list(self.rings) if epoch is None else [epoch]
            releasing = [r for e in epochs for r in self.rings.pop(e, [])]
        for r in releasing:
            r.release()
        return len(releasing)

    def close_window(self, epoch: int) -> None:
        """RETURN: the window's rings are zeroed and released, its data connections admitted for nothing
        (core/device/admission.py: each must be admitted again, with the next window's key)."""
        self.release_rings(epoch)
        self.admissions.close_window(epoch)

    def drop_ring(self, ring: ShmRing) -> None:
        """The holder's connection ended: unmap its ring (zeroed first)."""
        with self._rings_lock:
            for e, rs in list(self.rings.items()):
                if ring in rs:
                    rs.remove(ring)
                if not rs:
                    del self.rings[e]
        ring.close(zero=True)

    # --- scrub and shutdown ---------------------------------------------------------------------
    def scrub(self) -> None:
        """Zero the staging slots (they held plaintext on its way to device memory)."""
        st = self._staging
        if st is not None:
            st.flush()
            st.zero()

    def close(self) -> None:
        self.release_rings()
        self.admissions.close_window()
        if self._staging is not None:
            self._staging.close()
        for pool in (self.pool, self.frame_pool):
            if pool is not None:
                pool.shutdown(wait=False)
