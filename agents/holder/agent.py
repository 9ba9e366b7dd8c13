"""The holder agent: runs in a data holder's confidential VM, next to its private dataset.

Small and deployable: standard library, ``cryptography`` and ``gputravel.core.protocol`` only
(``python -m gputravel.agents.holder`` runs ``main``).
It speaks length-prefixed frames on stdin/stdout (locally, or through an SSH channel):

    agent -> HELLO {name, format, train_bytes, val_bytes, files, agent_sha256}
    orch  -> HANDOFF {epoch, session, key, window_offset, chunk_size, train: [start, n], val: [start, n], resume_from}
    agent -> CHUNK {e, s, o, n} + AES-GCM(ciphertext||tag)   ... device -> ACK {s} / ERROR {s, code, reason}
    agent -> DONE {epoch, chunks, bytes, retransmits}
    orch  -> BYE

The agent never sees any key but the one of the hand-off it is given, and that key only opens a
write window in the GPU's buffer for one epoch. Plaintext never leaves this process.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gputravel.agents.holder.bundle import agent_sha256
from gputravel.core.protocol import (
    TAG_LEN,
    DirectionKey,
    FrameType,
    SendState,
    encode_frame,
    read_frame,
    write_frame,
)
from gputravel.core.protocol.errors import AgentError, DataError, FrameError, GpuTravelError
from gputravel.core.protocol.frames import frame_head
from gputravel.core.protocol.shmring import (
    MAX_RING_BYTES,
    RingSpec,
    ShmRing,
    recv_frame_with_fds,
    ring_supported,
)

AGENT_VERSION = "1"
LLMC_MAGIC = 20240520
LLMC_HEADER = 256 * 4
#: chunks in flight on a socket (the TCP data port crosses machines: room for the bandwidth-delay product)
MAX_IN_FLIGHT = 32
#: slots of a shared-memory ring: few enough that the ring stays in the CPU's cache between the agent's
#: seal and the device's open (8 MiB at 1 MiB chunks); measured on the 2-core build machine, 6-8 slots with
#: acknowledgements in batches of half the ring beat 32 slots by about a fifth (docs/provisioning.md)
RING_SLOTS = 8
MAX_CHUNK = 16 * 1024 * 1024
MAX_RETRANSMITS = 3
#: on the direct path, acknowledgements are summed up for the orchestrator at most this often (and at the end):
#: each report crosses its link (an SSH channel), which costs more CPU than sealing a chunk
REPORT_EVERY_NS = 50_000_000


@dataclass(frozen=True, slots=True)
class Segment:
    path: Path
    start: int  # offset in the file
    length: int


class Stream:
    """A byte stream over several files, read by range through one read-only ``mmap`` per file (mapped
    once for the agent's life): a range inside one file is a view of the page cache, sealed from there
    with no copy; data is never loaded whole."""

    def __init__(self, segments: list[Segment], maps: dict[Path, mmap.mmap] | None = None) -> None:
        self.segments = segments
        self.length = sum(s.length for s in segments)
        self._maps: dict[Path, mmap.mmap] = {} if maps is None else maps  # shared with the streams split off

    def _map(self, seg: Segment) -> mmap.mmap:
        m = self._maps.get(seg.path)
        if m is None or len(m) < seg.start + seg.length:
            try:
                with open(seg.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < seg.start + seg.length:
                        raise DataError(f"{seg.path} shrank while being read")
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as exc:
                raise DataError(f"{seg.path}: cannot map the dataset file: {exc.strerror or exc}") from None
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            self._maps[seg.path] = m
        return m

    def check(self) -> None:
        """Raise ``DataError`` if a file was cut below the bytes this stream maps (reading a mapped page
        past the end of a file would kill the process with SIGBUS); called at every hand-off."""
        for seg in self.segments:
            try:
                size = os.stat(seg.path).st_size
            except OSError as exc:
                raise DataError(f"{seg.path}: {exc.strerror or exc}") from None
            if size < seg.start + seg.length:
                raise DataError(f"{seg.path} shrank while being read")

    def _check_range(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise DataError(f"range [{offset}, {offset + n}) beyond the {self.length}-byte stream")

    def view(self, offset: int, n: int) -> memoryview | None:
        """Bytes [offset, offset + n) as a read-only view of the file mapping (no copy), or None when the
        range spans two files."""
        self._check_range(offset, n)
        pos = 0
        for seg in self.segments:
            if offset < pos + seg.length:
                if offset + n > pos + seg.length:
                    return None
                lo = seg.start + offset - pos
                return memoryview(self._map(seg))[lo: lo + n]
            pos += seg.length
        return memoryview(b"") if n == 0 else None

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset + len(out)) (one copy, from the mapping)."""
        n = len(out)
        self._check_range(offset, n)
        pos = done = 0
        for seg in self.segments:
            if done == n:
                break
            if offset < pos + seg.length:
                skip = max(0, offset - pos)
                take = min(seg.length - skip, n - done)
                lo = seg.start + skip
                out[done: done + take] = memoryview(self._map(seg))[lo: lo + take]
                offset += take
                done += take
            pos += seg.length

    def read(self, offset: int, n: int) -> bytes:
        self._check_range(offset, n)
        out = bytearray(n)
        self.readinto(offset, memoryview(out))
        return bytes(out)

    def split(self, at: int) -> tuple[Stream, Stream]:
        left: list[Segment] = []
        right: list[Segment] = []
        pos = 0
        for seg in self.segments:
            if pos + seg.length <= at:
                left.append(seg)
            elif pos >= at:
                right.append(seg)
            else:
                cut = at - pos
                left.append(Segment(seg.path, seg.start, cut))
                right.append(Segment(seg.path, seg.start + cut, seg.length - cut))
            pos += seg.length
        return Stream(left, self._maps), Stream(right, self._maps)


@dataclass
class Dataset:
    fmt: str  # "byte" or "u16"
    train: Stream
    val: Stream
    files: int


def open_dataset(path: Path, *, val_fraction: float = 0.1) -> Dataset:
    """A holder's folder of .txt files (byte tokens) or llm.c .bin shards (uint16 tokens)."""
    if not path.is_dir():
        raise DataError(f"{path}: not a folder")
    txt = sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())
    bins = sorted(p for p in path.iterdir() if p.suffix == ".bin" and p.is_file())
    if txt and bins:
        raise DataError(f"{path}: mixes .txt and .bin files; use one format per holder")
    if not txt and not bins:
        raise DataError(f"{path}: no .txt or .bin files")
    segments: list[Segment] = []
    if txt:
        fmt, unit = "byte", 1
        for p in txt:
            size = p.stat().st_size
            if size:
                segments.append(Segment(p, 0, size))
    else:
        fmt, unit = "u16", 2
        for p in bins:
            with open(p, "rb") as f:
                head = f.read(LLMC_HEADER)
            if len(head) < LLMC_HEADER:
                raise DataError(f"{p}: shorter than an llm.c header")
            magic, version, ntok = struct.unpack("<3i", head[:12])
            if magic != LLMC_MAGIC or version != 1:
                raise DataError(f"{p}: not an llm.c token shard (magic {magic}, version {version})")
            if p.stat().st_size != LLMC_HEADER + 2 * ntok:
                raise DataError(f"{p}: header says {ntok} tokens, file size disagrees")
            segments.append(Segment(p, LLMC_HEADER, 2 * ntok))
    stream = Stream(segments)
    if stream.length == 0:
        raise DataError(f"{path}: all files are empty")
    val = int(stream.length * val_fraction) // unit * unit
    train, held = stream.split(stream.length - val)
    return Dataset(fmt, train, held, len(segments))


class SendFailed(AgentError):
    """Writing a sealed chunk to its link failed (posted by the sender thread)."""

    def __init__(self, reason: str) -> None:
        super().__init__("agent", reason)


class DataLinkLost(AgentError):
    """The data connection to the device dropped (posted by its reader; names the connection)."""

    def __init__(self, reason: str, conn: _DataConn) -> None:
        super().__init__("agent", reason)
        self.conn = conn


@dataclass
class ChunkOut:
    """Where one hand-off's sealed chunks go: the slots they are sealed into (slot ``k`` holds a chunk
    until it is acknowledged or refused, so a refused one is resent as is) and ``send(head, ct, slot)``."""

    slots: list[memoryview]
    send: Callable[[dict[str, Any], memoryview, int], None]


class _Sender:
    """One long-lived thread per agent that writes sealed chunks to their link while the agent seals the
    next ones (sealing and sending overlap). A failed write is posted to the agent's inbox."""

    def __init__(self, inbox: queue.Queue[Any]) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._inbox = inbox
        self._pending = 0
        self._idle = threading.Condition()
        threading.Thread(target=self._run, name="agent-sender", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._idle:
            self._pending += 1
        self._q.put((fn, args))

    def drain(self) -> None:
        """Wait until every submitted write finished (before the slots are reused)."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except (OSError, GpuTravelError, ValueError) as exc:
                self._inbox.put(SendFailed(f"sending a chunk failed: {exc}"))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


class Agent:
    def __init__(self, name: str, data: Dataset, out: BinaryIO, inp: BinaryIO, *,
                 witness: Path | None = None) -> None:
        self.name, self.data, self.out, self.inp = name, data, out, inp
        self.witness = witness
        self._write_lock = threading.Lock()
        self._inbox: queue.Queue[Any] = queue.Queue()
        # Long-lived: the send slots (allocated on the first hand-off, regrown only for a larger chunk size),
        # the gather buffer for a chunk that spans two files, the sender thread and the data connection.
        self._slots: list[bytearray] = []
        self._scratch = bytearray()
        self._sender = _Sender(self._inbox)
        self._data: _DataConn | None = None
        self.slot_allocations = 0  # how many times the slots were (re)allocated: once per agent, not per hand-off
        #: perf_counter_ns when the current HANDOFF was read (its set-up stage time starts there; 0: not yet)
        self.handoff_read_ns = 0

    def keep_witness(self, h: dict[str, Any], *, at: str = "hand-off") -> None:
        """Append the audit ledger's head, as the orchestrator stated it at this hand-off, to the holder's own
        witness file (JSON lines, 0600). With it the holder can later show that the ledger still holds that
        row unchanged (``gputravel ledger verify --witness``): no truncation, no rewrite behind its back."""
        head = h.get("ledger_head")
        if self.witness is None or not isinstance(head, str):
            return
        line = json.dumps({"ts": round(time.time(), 3), "holder": self.name, "at": at, "epoch": h.get("epoch"),
                           "ledger_head": head}) + "\n"
        try:
            self.witness.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.witness, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:  # the hand-off goes on: the witness is the holder's record, not the protocol's
            print(f"gputravel agent {self.name}: cannot write the witness {self.witness}: {exc}", file=sys.stderr)

    def send(self, ftype: FrameType, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        with self._write_lock:
            write_frame(self.out, ftype, header, payload)
            self.out.flush()

    def send_all(self, frames: list[tuple[FrameType, dict[str, Any]]]) -> None:
        """Several header-only frames in one write to the link (one SSH packet where they fit)."""
        with self._write_lock:
            for ftype, header in frames:
                write_frame(self.out, ftype, header)
            self.out.flush()

    def _reader(self) -> None:
        try:
            while True:
                frame = read_frame(self.inp)
                self._inbox.put(frame)
                if frame is None:
                    return
        except GpuTravelError as exc:
            self._inbox.put(exc)

    def run(self) -> int:
        self.send(FrameType.HELLO, {"name": self.name, "version": AGENT_VERSION, "format": self.data.fmt,
                                    "train_bytes": self.data.train.length, "val_bytes": self.data.val.length,
                                    "files": self.data.files, "agent_sha256": agent_sha256(), "pid": os.getpid()})
        threading.Thread(target=self._reader, daemon=True).start()
        try:
            while True:
                frame = self._inbox.get()
                if isinstance(frame, (DataLinkLost, SendFailed)):  # between hand-offs: the next one reconnects
                    continue
                if frame is None or isinstance(frame, Exception):
                    return 0 if frame is None else 4
                if frame.type is FrameType.HANDOFF:
                    self.handoff_read_ns = time.perf_counter_ns()  # the set-up stage starts here
                    self.keep_witness(frame.header)
                    try:
                        self.provision(frame.header)
                    except GpuTravelError as exc:
                        self.send(FrameType.ERROR, {"code": exc.code, "reason": exc.reason})
                elif frame.type is FrameType.PING:
                    self.send(FrameType.PONG, frame.header)
                elif frame.type is FrameType.BYE:
                    self.keep_witness(frame.header, at="end")  # the head after every visit of the run
                    return 0
        finally:
            self._drop_data()

    def _window_into(self, h: dict[str, Any], start: int, out: memoryview) -> None:
        """Fill ``out`` with window bytes [start, start + len(out)): the train slice, then the val slice."""
        t0, tn = h["train"]
        v0, _vn = h["val"]
        n = len(out)
        done = 0
        if start < tn:
            take = min(n, tn - start)
            self.data.train.readinto(t0 + start, out[:take])
            start, done = start + take, take
        if done < n:
            self.data.val.readinto(v0 + start - tn, out[done:])

    def _window_view(self, h: dict[str, Any], start: int, n: int) -> memoryview:
        """Window bytes [start, start + n) as a view of the file mapping where they lie in one file of one
        slice (no copy), else gathered into the agent's one scratch buffer."""
        t0, tn = h["train"]
        v0, _vn = h["val"]
        view = None
        if start + n <= tn:
            view = self.data.train.view(t0 + start, n)
        elif start >= tn:
            view = self.data.val.view(v0 + start - tn, n)
        if view is not None:
            return view
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        out = memoryview(self._scratch)[:n]
        self._window_into(h, start, out)
        return out

    def _slot_views(self, count: int, size: int) -> list[memoryview]:
        """``count`` send slots of ``size`` bytes from the agent's long-lived pool."""
        if self._slots and len(self._slots[0]) < size:
            self._slots = []  # a larger chunk size than any before: the only time slots are replaced
        if len(self._slots) < count:
            self.slot_allocations += 1
            self._slots += [bytearray(max(size, len(self._slots[0]) if self._slots else size))
                            for _ in range(count - len(self._slots))]
        return [memoryview(b)[:size] for b in self._slots[:count]]

    def _data_conn(self, endpoint: dict[str, Any], session: bytes) -> _DataConn:
        """The data connection for this device session: kept across hand-offs, reopened when the device,
        its session or the endpoint changed, or the connection dropped."""
        key = (json.dumps(endpoint, sort_keys=True), session)
        conn = self._data
        if conn is not None and (conn.key != key or conn.dead):
            self._drop_data()
            conn = None
        if conn is None:
            conn = self._data = _DataConn(endpoint, session, self._inbox, key=key)
        return conn

    def _drop_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def provision(self, h: dict[str, Any]) -> None:
        """One hand-off: seal the window's chunks and send them (direct path, ring or frames, or this link)."""
        plain = bool(h.get("plain"))  # the conventional path: no GPU key here; the link's own encryption only
        key = DirectionKey.from_wire(h["key"]) if not plain else None
        epoch = int(h["epoch"])
        session = bytes.fromhex(h["session"])
        base = int(h["window_offset"])
        cs = int(h["chunk_size"])
        skip = int(h.get("skip", 0))
        total = int(h.get("length", int(h["train"][1]) + int(h["val"][1]) - skip))
        if skip < 0 or total <= 0 or skip + total > int(h["train"][1]) + int(h["val"][1]):
            raise DataError(f"hand-off window [{skip}, {skip + total}) is outside this visit's data")
        if int(h["train"][0]) + int(h["train"][1]) > self.data.train.length or \
                int(h["val"][0]) + int(h["val"][1]) > self.data.val.length:
            raise DataError("hand-off asks for bytes beyond this holder's dataset")
        if not 0 < cs <= MAX_CHUNK:
            raise DataError(f"chunk size {cs} outside 1..{MAX_CHUNK}")
        self.data.train.check()
        self.data.val.check()
        n_chunks = (total + cs - 1) // cs
        start = int(h.get("resume_from", 0))
        sender = SendState(key, session_id=session, start=start) if key is not None else None
        endpoint = h.get("data_endpoint")
        in_flight = min(MAX_IN_FLIGHT, n_chunks - start) or 1
        conn = ring = None
        out: ChunkOut | None = None
        try:
            if endpoint:
                conn = self._data_conn(endpoint, session)
                conn.active = True
                if conn.rings and sender is not None and endpoint.get("ring", True):
                    slots = max(1, min(in_flight, RING_SLOTS, MAX_RING_BYTES // (cs + TAG_LEN)))
                    ring = self._open_ring(conn, RingSpec(epoch, slots, cs + TAG_LEN))
            if ring is not None and conn is not None:
                out = ChunkOut(conn.ring_slots, conn.notify)
            elif conn is not None:
                c = conn
                out = ChunkOut(self._slot_views(in_flight, cs + TAG_LEN),
                               lambda head, ct, _slot: self._sender.submit(c.send, head, ct))
            else:
                out = ChunkOut(self._slot_views(in_flight, cs + TAG_LEN),
                               lambda head, ct, _slot: self._sender.submit(self.send, FrameType.CHUNK, head, ct))
            self._provision_loop(h, sender, out, conn is not None, epoch=epoch, base=base, cs=cs, total=total,
                                 n_chunks=n_chunks, start=start, skip=skip)
        except BaseException:
            if conn is not None:  # a failed hand-off leaves nothing behind: a fresh connection next time
                self._drop_data()
            raise
        finally:
            self._sender.drain()  # no write may still read a slot when the next hand-off reuses it
            if conn is not None:
                conn.active = False
                if conn.awaiting is not None:  # a bind never answered: its answer must not meet the next one
                    self._drop_data()

    def _open_ring(self, conn: _DataConn, spec: RingSpec) -> ShmRing | None:
        """Ask the device to bind this connection's ring to this epoch (it sends the ring's descriptor the
        first time, or for another shape); None (chunks go in socket frames) if it declines.

        A connection that already maps a ring of this shape does not wait for the answer: the device reads
        this connection in order, so the bind is done before it reads the first chunk's slot id, and the
        agent seals meanwhile (the round trip, about a quarter of a millisecond, leaves the hand-off's fixed
        cost). The answer is checked when it comes (``_DataConn.confirm_ring``); a refusal fails the
        hand-off, and the chunks already announced are refused by the device as for an unbound ring."""
        conn.request_ring(spec)
        if conn.ring is not None and not conn.ring.closed and conn.ring.same_shape(spec):
            conn.ring.bind(epoch=spec.epoch)
            conn.awaiting = spec
            return conn.ring
        while True:
            item = self._inbox.get()
            if isinstance(item, _RingOffer) and item.conn is conn:
                try:
                    offered = RingSpec.from_wire(item.header.get("ring"))
                    if offered != spec:
                        raise FrameError(f"the device offered ring {offered}, not {spec}")
                    if item.fd >= 0:
                        conn.set_ring(ShmRing.attach(item.fd, spec))
                    elif conn.ring is None or not conn.ring.same_shape(spec):
                        raise FrameError("the device reuses a ring this connection does not have")
                    assert conn.ring is not None
                    conn.ring.bind(epoch=spec.epoch)
                    return conn.ring
                except GpuTravelError as exc:
                    if item.fd >= 0 and conn.ring is None:
                        os.close(item.fd)
                    raise GpuTravelError(f"the device's ring is unusable: {exc.reason}", code="agent") from None
            if isinstance(item, DataLinkLost):
                if item.conn is conn:
                    raise item
                continue
            if isinstance(item, GpuTravelError):
                raise item
            if item is None or isinstance(item, Exception):
                self._inbox.put(item)
                raise GpuTravelError("link closed during provisioning")
            if item.type is FrameType.ERROR and item.header.get("ring"):
                print(f"gputravel agent {self.name}: no shared-memory ring ({item.header.get('reason')}); "
                      "chunks go over the socket", file=sys.stderr)
                return None
            if item.type is FrameType.PING:
                self.send(FrameType.PONG, item.header)
            elif item.type is FrameType.BYE:
                raise GpuTravelError("orchestrator ended the hand-off")

    def _provision_loop(self, h: dict[str, Any], sender: SendState | None, out: ChunkOut, direct: bool, *,
                        epoch: int, base: int, cs: int, total: int, n_chunks: int, start: int,
                        skip: int = 0) -> None:
        # Each chunk is sealed straight from the file mapping into a free slot (encrypt_into: the one pass
        # over the bytes), then handed to the link: a sender thread writes it while the next one is sealed
        # (or, with a shared-memory ring, only the slot id crosses the socket). A chunk stays in its slot
        # until acknowledged; then the slot is reused. Nothing is allocated per chunk or per hand-off.
        free = list(range(len(out.slots)))
        sealed: dict[int, tuple[dict[str, Any], memoryview, int]] = {}
        acked: set[int] = set(range(start))
        retransmits = 0
        unreported = 0
        seq = start
        clock = time.perf_counter_ns
        seal_ns = wait_ns = 0
        reported_last = -1
        begun = clock()
        reported_at = begun - REPORT_EVERY_NS  # the first acknowledgement is reported at once, the last with DONE
        while len(acked) < n_chunks:
            while seq < n_chunks and free:
                t0 = clock()
                lo = seq * cs
                n = min(cs, total - lo)
                slot = free.pop()
                head: dict[str, Any] = {"e": epoch, "s": seq, "o": base + lo, "n": n}
                if direct:  # the device may acknowledge in batches, and must flush them before this agent waits
                    head["f"] = 1 if seq == n_chunks - 1 or not free else 0
                if sender is None:  # conventional path: plaintext rides the (SSH-encrypted) link, read into its slot
                    ct = out.slots[slot][:n]
                    self._window_into(h, skip + lo, ct)
                    head["plain"] = 1
                else:
                    ct = out.slots[slot][: n + TAG_LEN]
                    got = sender.seal_into(self._window_view(h, skip + lo, n), ct, frame_type=FrameType.CHUNK,
                                           offset=base + lo, length=n)
                    assert got == seq
                sealed[seq] = (head, ct, slot)
                seal_ns += clock() - t0
                out.send(head, ct, slot)
                seq += 1
            t0 = clock()
            frame = self._inbox.get()
            wait_ns += clock() - t0
            if isinstance(frame, DataLinkLost) and frame.conn is not self._data:
                continue  # a data connection of an earlier hand-off
            if isinstance(frame, GpuTravelError):
                raise frame
            if frame is None or isinstance(frame, Exception):
                self._inbox.put(frame)  # the main loop must see the end of the link too, or it waits forever
                raise GpuTravelError("link closed during provisioning")
            if isinstance(frame, _RingOffer):
                frame.conn.confirm_ring(frame)  # the answer to this hand-off's bind (or one not asked for)
                continue
            if frame.type is FrameType.ACK:
                batch = frame.header.get("batch")  # the direct path's batched acknowledgements: a list of seqs
                fresh = 0
                last = -1
                for s in batch if isinstance(batch, list) else (frame.header.get("s"),):
                    if type(s) is not int or s in acked or s >= seq:
                        continue  # a duplicate, or an acknowledgement of nothing sent: ignored
                    acked.add(s)
                    if s in sealed:
                        free.append(sealed.pop(s)[2])
                    fresh += 1
                    last = max(last, s)
                if direct and fresh:  # progress for the orchestrator, at most every REPORT_EVERY_NS (slow link)
                    unreported += fresh
                    now = clock()
                    if now - reported_at >= REPORT_EVERY_NS and len(acked) < n_chunks:
                        self.send(FrameType.ACK, {"s": last, "n": unreported})
                        unreported, reported_at = 0, now
                    reported_last = last
            elif frame.type is FrameType.ERROR and frame.header.get("ring"):  # the answer to a bind not waited for
                raise GpuTravelError(f"the device refused this hand-off's ring: {frame.header.get('reason')}",
                                     code=str(frame.header.get("code") or "agent"))
            elif frame.type is FrameType.ERROR and frame.header.get("s") is not None:
                if direct:
                    self.send(FrameType.ERROR, frame.header)
                s = int(frame.header["s"])
                if frame.header.get("code") == "replay":  # already in the buffer: an acknowledgement was lost
                    if s in sealed:
                        acked.add(s)
                        free.append(sealed.pop(s)[2])
                    continue
                if s not in sealed or retransmits >= MAX_RETRANSMITS * n_chunks or frame.header.get("code") in (
                        "stale-epoch", "window"):
                    raise GpuTravelError(f"chunk {s} refused: {frame.header.get('reason')}",
                                         code=str(frame.header.get("code")))
                retransmits += 1
                head, ct, slot = sealed[s]
                if direct:
                    head["f"] = 1  # the agent waits for this one's answer: no acknowledgement may be held back
                out.send(head, ct, slot)
            elif frame.type is FrameType.BYE:
                raise GpuTravelError("orchestrator ended the hand-off")
            elif frame.type is FrameType.PING:
                self.send(FrameType.PONG, frame.header)
        # the last progress report and DONE leave in one write. Stage times for ``bench provision``: reading
        # and sealing, waiting for slots to be acknowledged, and the data phase (first seal to last
        # acknowledgement) within the agent's whole hand-off (HANDOFF read to DONE written)
        now = clock()
        done = {"epoch": epoch, "chunks": n_chunks - start, "bytes": total, "retransmits": retransmits,
                "stages": {"read_seal_s": seal_ns / 1e9, "wait_s": wait_ns / 1e9,
                           "setup_s": (begun - (self.handoff_read_ns or begun)) / 1e9,
                           "data_s": (now - begun) / 1e9}}
        frames: list[tuple[FrameType, dict[str, Any]]] = [(FrameType.DONE, done)]
        if direct and unreported:
            frames.insert(0, (FrameType.ACK, {"s": reported_last, "n": unreported}))
        self.send_all(frames)


@dataclass(frozen=True)
class _RingOffer:
    """The device's DATA_READY for a ring request, with the ring's descriptor (owned by the receiver), or
    ``fd`` -1 where the device binds the ring this connection already maps."""

    conn: _DataConn
    header: dict[str, Any]
    fd: int


class _DataConn:
    """The direct path: one data connection from the agent to the device's data port, kept for the agent's
    session with that device. On the device's Unix socket (same host) it can carry a shared-memory ring
    per hand-off; on TCP (holders on other machines) chunks travel in frames."""

    def __init__(self, endpoint: dict[str, Any], session: bytes, inbox: queue.Queue[Any], *,
                 key: tuple[str, bytes]) -> None:
        self.key = key
        self.session = session
        self.unix = bool(endpoint.get("path"))
        try:
            if self.unix:  # same host: the device's Unix socket
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(30)
                self.sock.connect(str(endpoint["path"]))
            else:
                self.sock = socket.create_connection((str(endpoint["host"]), int(endpoint["port"])), timeout=30)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            want_rings = self.unix and ring_supported()
            self.sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": session.hex(),
                                                                 **({"rings": 1} if want_rings else {})}))
            got = recv_frame_with_fds(self.sock)
        except (OSError, GpuTravelError) as exc:
            if hasattr(self, "sock"):
                self.sock.close()
            raise GpuTravelError(f"cannot reach the device data port {endpoint}: {exc}", code="agent") from None
        ready = got[0] if got else None
        for fd in got[1] if got else ():
            os.close(fd)
        if ready is None or ready.type is not FrameType.DATA_READY:
            reason = ready.header.get("reason") if ready else "closed"
            self.sock.close()
            raise GpuTravelError(f"the device refused the data connection: {reason}", code="agent")
        self.sock.settimeout(None)
        self.rings = want_rings and bool(ready.header.get("rings"))  # the device offers rings on this connection
        self.inbox = inbox
        self.active = False  # a hand-off is using it: frames go to the inbox (between hand-offs they are dropped)
        self.closing = False
        self.dead = False
        self._send_lock = threading.Lock()
        #: this connection's shared-memory ring (mapped once, bound per hand-off) and its slot views
        self.ring: ShmRing | None = None
        self.ring_slots: list[memoryview] = []
        #: a bind asked for and not yet answered (the agent seals meanwhile: ``Agent._open_ring``)
        self.awaiting: RingSpec | None = None
        threading.Thread(target=self._reader, name="agent-data-reader", daemon=True).start()

    def _reader(self) -> None:
        try:
            while True:
                got = recv_frame_with_fds(self.sock)
                if got is None:
                    break
                frame, fds = got
                if frame.type is FrameType.DATA_READY and "ring" in frame.header and self.active:
                    self.inbox.put(_RingOffer(self, frame.header, fds[0] if fds else -1))
                    for fd in fds[1:]:
                        os.close(fd)
                    continue
                for fd in fds:
                    os.close(fd)
                if self.active:
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

    def confirm_ring(self, offer: _RingOffer) -> None:
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
            raise GpuTravelError("the device sent a new ring for a bind of the one this connection maps",
                                 code="agent")
        try:
            offered = RingSpec.from_wire(offer.header.get("ring"))
        except GpuTravelError as exc:
            raise GpuTravelError(f"the device's ring is unusable: {exc.reason}", code="agent") from None
        if offered != spec:
            raise GpuTravelError(f"the device bound ring {offered}, not {spec}", code="agent")

    def request_ring(self, spec: RingSpec) -> None:
        with self._send_lock:
            self.sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": self.session.hex(),
                                                                 "ring": spec.to_wire()}))

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gputravel-agent", description="gputravel holder agent (stdio framing)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--witness", type=Path, default=None,
                        help="append the ledger head stated at each hand-off to this file (~ expands)")
    ns = parser.parse_args(argv)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the real stdout
    try:
        try:
            data = open_dataset(ns.data, val_fraction=ns.val_fraction)
        except OSError as exc:  # e.g. another holder's folder: permission denied, named rather than a traceback
            raise DataError(f"{exc.filename or ns.data}: cannot read the dataset: {exc.strerror or exc}") from None
    except GpuTravelError as exc:
        write_frame(out, FrameType.ERROR, {"code": exc.code, "reason": exc.reason})
        out.flush()
        return 2
    return Agent(ns.name, data, out, inp, witness=ns.witness.expanduser() if ns.witness else None).run()
