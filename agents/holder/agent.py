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
import os
import queue
import socket
import struct
import sys
import threading
import time
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
from gputravel.core.protocol.errors import DataError, GpuTravelError
from gputravel.core.protocol.frames import frame_head

AGENT_VERSION = "1"
LLMC_MAGIC = 20240520
LLMC_HEADER = 256 * 4
MAX_IN_FLIGHT = 32
MAX_RETRANSMITS = 3


@dataclass(frozen=True, slots=True)
class Segment:
    path: Path
    start: int  # offset in the file
    length: int


class Stream:
    """A byte stream over several files, read by range (data is never loaded whole)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.length = sum(s.length for s in segments)
        self._files: dict[Path, BinaryIO] = {}

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset + len(out)) without intermediate copies."""
        n = len(out)
        if offset < 0 or offset + n > self.length:
            raise DataError(f"range [{offset}, {offset + n}) beyond the {self.length}-byte stream")
        pos = done = 0
        for seg in self.segments:
            if done == n:
                break
            if offset < pos + seg.length:
                skip = max(0, offset - pos)
                take = min(seg.length - skip, n - done)
                f = self._files.get(seg.path)
                if f is None:
                    f = self._files[seg.path] = open(seg.path, "rb", buffering=0)  # noqa: SIM115
                f.seek(seg.start + skip)
                got = 0
                while got < take:
                    k = f.readinto(out[done + got: done + take])
                    if not k:
                        raise DataError(f"{seg.path} shrank while being read")
                    got += k
                offset += take
                done += take
            pos += seg.length

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise DataError(f"range [{offset}, {offset + n}) beyond the {self.length}-byte stream")
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
        return Stream(left), Stream(right)


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


class Agent:
    def __init__(self, name: str, data: Dataset, out: BinaryIO, inp: BinaryIO, *,
                 witness: Path | None = None) -> None:
        self.name, self.data, self.out, self.inp = name, data, out, inp
        self.witness = witness
        self._write_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()

    def keep_witness(self, h: dict, *, at: str = "hand-off") -> None:
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

    def send(self, ftype: FrameType, header: dict, payload: bytes | bytearray | memoryview = b"") -> None:
        with self._write_lock:
            write_frame(self.out, ftype, header, payload)
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
        while True:
            frame = self._inbox.get()
            if frame is None or isinstance(frame, Exception):
                return 0 if frame is None else 4
            if frame.type is FrameType.HANDOFF:
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

    def _window_into(self, h: dict, start: int, out: memoryview) -> None:
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

    def provision(self, h: dict) -> None:
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
        n_chunks = (total + cs - 1) // cs
        start = int(h.get("resume_from", 0))
        sender = SendState(key, session_id=session, start=start) if key is not None else None
        endpoint = h.get("data_endpoint")
        device = _DeviceSocket(endpoint, session, self._inbox) if endpoint else None
        send_chunk = device.send if device else (lambda head, ct: self.send(FrameType.CHUNK, head, ct))
        try:
            self._provision_loop(h, sender, send_chunk, device is not None, epoch=epoch, base=base, cs=cs,
                                 total=total, n_chunks=n_chunks, start=start, skip=skip)
        finally:
            if device:
                device.close()

    def _provision_loop(self, h: dict, sender: SendState | None, send_chunk: Any, direct: bool, *, epoch: int,
                        base: int,
                        cs: int, total: int, n_chunks: int, start: int, skip: int = 0) -> None:
        # A ring of sealed-chunk slots: a chunk's ciphertext stays in its slot until acknowledged
        # (so a rejected chunk is retransmitted as is), then the slot is reused. No per-chunk copies.
        slots = [bytearray(cs + TAG_LEN) for _ in range(min(MAX_IN_FLIGHT, n_chunks - start) or 1)]
        free = list(range(len(slots)))
        plain = bytearray(cs)
        sealed: dict[int, tuple[dict, memoryview, int]] = {}
        acked: set[int] = set(range(start))
        retransmits = 0
        unreported = 0
        seq = start
        while len(acked) < n_chunks:
            while seq < n_chunks and free:
                lo = seq * cs
                n = min(cs, total - lo)
                slot = free.pop()
                head = {"e": epoch, "s": seq, "o": base + lo, "n": n}
                if sender is None:  # conventional path: plaintext rides the (SSH-encrypted) link, read into its slot
                    ct = memoryview(slots[slot])[:n]
                    self._window_into(h, skip + lo, ct)
                    head["plain"] = 1
                else:
                    view = memoryview(plain)[:n]
                    self._window_into(h, skip + lo, view)
                    ct = memoryview(slots[slot])[: n + TAG_LEN]
                    got = sender.seal_into(view, ct, frame_type=FrameType.CHUNK, offset=base + lo, length=n)
                    assert got == seq
                sealed[seq] = (head, ct, slot)
                send_chunk(head, ct)
                seq += 1
            frame = self._inbox.get()
            if isinstance(frame, GpuTravelError):
                raise frame
            if frame is None or isinstance(frame, Exception):
                self._inbox.put(frame)  # the main loop must see the end of the link too, or it waits forever
                raise GpuTravelError("link closed during provisioning")
            if frame.type is FrameType.ACK:
                s = int(frame.header["s"])
                acked.add(s)
                if s in sealed:
                    free.append(sealed.pop(s)[2])
                if direct:
                    unreported += 1
                    if unreported >= 8 or len(acked) == n_chunks:
                        self.send(FrameType.ACK, {"s": s, "n": unreported})
                        unreported = 0
            elif frame.type is FrameType.ERROR and frame.header.get("s") is not None:
                if direct:
                    self.send(FrameType.ERROR, frame.header)
                s = int(frame.header["s"])
                if frame.header.get("code") == "replay":  # already in the buffer: an acknowledgement was lost
                    acked.add(s)
                    if s in sealed:
                        free.append(sealed.pop(s)[2])
                    continue
                if s not in sealed or retransmits >= MAX_RETRANSMITS * n_chunks or frame.header.get("code") in (
                        "stale-epoch", "window"):
                    raise GpuTravelError(f"chunk {s} refused: {frame.header.get('reason')}",
                                         code=str(frame.header.get("code")))
                retransmits += 1
                head, ct, _slot = sealed[s]
                send_chunk(head, ct)
            elif frame.type is FrameType.BYE:
                raise GpuTravelError("orchestrator ended the hand-off")
            elif frame.type is FrameType.PING:
                self.send(FrameType.PONG, frame.header)
        self.send(FrameType.DONE, {"epoch": epoch, "chunks": n_chunks - start, "bytes": total,
                                   "retransmits": retransmits})


class _DeviceSocket:
    """The direct path: a data connection from the agent to the device's data port."""

    def __init__(self, endpoint: dict, session: bytes, inbox: queue.Queue) -> None:
        try:
            if endpoint.get("path"):  # same host: the device's Unix socket
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(30)
                self.sock.connect(str(endpoint["path"]))
            else:
                self.sock = socket.create_connection((str(endpoint["host"]), int(endpoint["port"])), timeout=30)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        except OSError as exc:
            raise GpuTravelError(f"cannot reach the device data port {endpoint}: {exc}", code="agent") from None
        self.sock.settimeout(None)
        self.stream = self.sock.makefile("rb", buffering=1 << 16)
        self.sock.sendall(encode_frame(FrameType.DATA_OPEN, {"session": session.hex()}))
        ready = read_frame(self.stream)
        if ready is None or ready.type is not FrameType.DATA_READY:
            reason = ready.header.get("reason") if ready else "closed"
            raise GpuTravelError(f"the device refused the data connection: {reason}", code="agent")
        self.inbox = inbox
        self.closing = False
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        try:
            while True:
                frame = read_frame(self.stream)
                if frame is None:
                    break
                self.inbox.put(frame)
        except (GpuTravelError, OSError, ValueError):
            pass
        if not self.closing:  # the device went away mid-transfer: fail the hand-off instead of waiting forever
            self.inbox.put(GpuTravelError("the device closed the data connection", code="agent"))

    def send(self, head: dict, payload: bytes | bytearray | memoryview) -> None:
        self.sock.sendall(frame_head(FrameType.CHUNK, head, len(payload)))
        self.sock.sendall(payload)

    def close(self) -> None:
        self.closing = True
        try:
            self.sock.sendall(encode_frame(FrameType.BYE, {}))
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


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
