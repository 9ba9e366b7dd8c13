"""A holder's dataset: a folder of .txt files (byte tokens) or llm.c .bin shards (uint16 or uint32 tokens), read by
range through read-only file mappings (never loaded whole)."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from gputravel.core.protocol.errors import DataError
from gputravel.core.protocol.shards import SHARD_HEADER_BYTES, TOKEN_BYTES, parse_shard_header

__all__ = ["LLMC_HEADER", "Dataset", "Segment", "Stream", "open_dataset"]

LLMC_HEADER = SHARD_HEADER_BYTES


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
    fmt: str  # "byte", "u16" or "u32"
    train: Stream
    val: Stream
    files: int


def open_dataset(path: Path, *, val_fraction: float = 0.1) -> Dataset:
    """A holder's folder of .txt files (byte tokens) or llm.c .bin shards (uint16 or uint32 tokens, one width)."""
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
        fmts = set()
        for p in bins:
            with open(p, "rb") as f:
                head = f.read(LLMC_HEADER)
                size = os.fstat(f.fileno()).st_size
            shard = parse_shard_header(head, size, p)
            fmts.add(shard.fmt)
            segments.append(Segment(p, LLMC_HEADER, shard.payload_bytes))
        if len(fmts) > 1:
            raise DataError(f"{path}: mixes u16 and u32 shards; one holder uses one token width")
        fmt = fmts.pop()
        unit = TOKEN_BYTES[fmt]
    stream = Stream(segments)
    if stream.length == 0:
        raise DataError(f"{path}: all files are empty")
    val = int(stream.length * val_fraction) // unit * unit
    train, held = stream.split(stream.length - val)
    return Dataset(fmt, train, held, len(segments))

