"""The checkpoint file: its format, and its reader (``CheckpointFile``). Torch-free, as the store that
writes and keeps these files (:mod:`gputravel.core.training.store`).

**The file** (``ckpt-{seq:06d}.gtc``), the sealed chunks of one stream (:mod:`gputravel.core.protocol.stream`)
as records::

    magic b"GTCK" | version u8 (2) | header length u32 | header (JSON: the stream header)
    record*:  kind u8 (0 data, 1 end, 2 meta) | length u32 | bytes
              data and end records are sealed chunks exactly as the sealer produced them; the one meta
              record (last) is plaintext JSON the orchestrator adds (model digest, tag digest, epoch...)

A reader checks the file name against the sealed sequence number, the run against the caller's, the header's
size and kind, every record's kind and size, and the meta record's digest of the chunks' tags; a truncated file
is a ``DataError`` and an altered one a ``TagError``, each naming the file and the chunk. It hands the sealed
chunks on without opening them (the store's ``chunks`` opens them under the run key).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gputravel.core.errors import DataError, FrameError, TagError
from gputravel.core.protocol.cipher import TAG_LEN
from gputravel.core.protocol.stream import StreamHeader

__all__ = ["CHECKPOINT_VERSION", "FILE_NAME", "MAX_HEADER", "REC_DATA", "REC_END", "REC_META", "STREAM_KIND",
           "CheckpointFile", "file_head", "record_head"]

CHECKPOINT_VERSION = 2
#: the stream kind a checkpoint's header names
STREAM_KIND = "checkpoint"
MAGIC = b"GTCK"
FILE_HEAD = struct.Struct(">4sBI")
RECORD = struct.Struct(">BI")
REC_DATA, REC_END, REC_META = 0, 1, 2
#: a checkpoint's file name: its sequence number, six digits or more
FILE_NAME = re.compile(r"^ckpt-(\d{6,})\.gtc$")
#: the largest header and meta record a reader accepts
MAX_HEADER = 64 * 1024


def file_head(header: StreamHeader) -> bytes:
    """A checkpoint file's first bytes: magic, version and the stream header as JSON."""
    raw = json.dumps({"stream": header.to_dict()}, sort_keys=True, separators=(",", ":")).encode()
    return FILE_HEAD.pack(MAGIC, CHECKPOINT_VERSION, len(raw)) + raw


def record_head(kind: int, n: int) -> bytes:
    """A record's head: its kind and length."""
    return RECORD.pack(kind, n)


class CheckpointFile:
    """A checkpoint file opened for reading: header checked, records read one at a time."""

    def __init__(self, path: Path, *, run_id: str | None = None) -> None:
        self.path = Path(path)
        try:
            self._f: BinaryIO = open(self.path, "rb")  # noqa: SIM115  (closed by close()/the context manager)
        except FileNotFoundError:
            raise DataError(f"checkpoint {self.path} does not exist") from None
        try:
            self.header = self._read_header()
            m = FILE_NAME.match(self.path.name)
            if m and int(m.group(1)) != self.header.seq:
                raise TagError(f"checkpoint {self.path} was sealed as seq {self.header.seq}; the file was renamed")
            if run_id is not None and self.header.run_id != run_id:
                raise TagError(f"checkpoint {self.path} belongs to run {self.header.run_id!r}, not {run_id!r}")
        except BaseException:
            self._f.close()
            raise
        self.data_start = self._f.tell()
        self.meta: dict[str, Any] | None = None

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def _exact(self, n: int, what: str) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise DataError(f"checkpoint {self.path} is truncated: {what} has {len(data)} of {n} bytes")
        return data

    def _read_header(self) -> StreamHeader:
        magic, version, n = FILE_HEAD.unpack(self._exact(FILE_HEAD.size, "the file header"))
        if magic != MAGIC:
            raise TagError(f"{self.path} is not a sealed gputravel checkpoint (bad magic)")
        if version != CHECKPOINT_VERSION:
            raise DataError(f"checkpoint {self.path} has format version {version}, this build reads "
                            f"{CHECKPOINT_VERSION}")
        if n > MAX_HEADER:
            raise TagError(f"checkpoint {self.path}: header of {n} bytes is over the limit (altered)")
        raw = self._exact(n, "the file header")
        try:
            data = json.loads(raw.decode())
            header = StreamHeader.from_dict(data["stream"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, FrameError) as exc:
            raise TagError(f"checkpoint {self.path}: header is malformed (altered): {exc}") from None
        if header.kind != STREAM_KIND:
            raise TagError(f"checkpoint {self.path} holds a {header.kind!r} stream, not a checkpoint")
        return header

    def records(self, buf: bytearray | None = None) -> Iterator[tuple[int, memoryview]]:
        """``(kind, sealed bytes)`` of every data chunk and then the end chunk; reads the meta record after.

        The bytes are a view of one reused buffer. Raises ``DataError`` naming the chunk where the file
        is cut, ``TagError`` for an unknown record or trailing bytes."""
        self._f.seek(self.data_start)
        limit = self.header.max_sealed
        buf = buf if buf is not None and len(buf) >= limit else bytearray(limit)
        index = 0
        tags = hashlib.sha256(b"gputravel/stream-tags/v1\0" + self.header.digest())
        while True:
            raw = self._f.read(RECORD.size)
            if len(raw) < RECORD.size:
                raise DataError(f"checkpoint {self.path} is truncated: it ends before chunk {index} "
                                "(no end chunk)")
            kind, n = RECORD.unpack(raw)
            if kind not in (REC_DATA, REC_END) or n > limit:
                raise TagError(f"checkpoint {self.path}: chunk {index} has a bad record (kind {kind}, {n} bytes)")
            view = memoryview(buf)[:n]
            got = self._f.readinto(view)  # type: ignore[attr-defined]
            if got != n:
                raise DataError(f"checkpoint {self.path} is truncated: chunk {index} has {got} of {n} bytes")
            tags.update(view[-TAG_LEN:])
            yield kind, view
            index += 1
            if kind == REC_END:
                break
        self.meta = self._read_meta()
        if self.meta.get("tag_digest") != tags.hexdigest():
            raise TagError(f"checkpoint {self.path}: its meta record does not match its chunks (altered)")

    def _read_meta(self) -> dict[str, Any]:
        raw = self._f.read(RECORD.size)
        if len(raw) < RECORD.size:
            raise DataError(f"checkpoint {self.path} is truncated: its meta record is missing")
        kind, n = RECORD.unpack(raw)
        if kind != REC_META or n > MAX_HEADER:
            raise TagError(f"checkpoint {self.path}: bad meta record (kind {kind}, {n} bytes)")
        body = self._exact(n, "the meta record")
        if self._f.read(1):
            raise TagError(f"checkpoint {self.path} has unexpected trailing bytes")
        try:
            meta = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError):
            raise TagError(f"checkpoint {self.path}: meta record is not JSON (altered)") from None
        if not isinstance(meta, dict):
            raise TagError(f"checkpoint {self.path}: meta record is not a JSON object (altered)")
        return meta

    def read_meta(self) -> dict[str, Any]:
        """The orchestrator's plaintext meta record (skips the chunks without opening them)."""
        self._f.seek(self.data_start)
        index = 0
        while True:
            raw = self._f.read(RECORD.size)
            if len(raw) < RECORD.size:
                raise DataError(f"checkpoint {self.path} is truncated: it ends before chunk {index} (no end chunk)")
            kind, n = RECORD.unpack(raw)
            if kind not in (REC_DATA, REC_END):
                raise TagError(f"checkpoint {self.path}: chunk {index} has a bad record (kind {kind})")
            self._f.seek(n, os.SEEK_CUR)
            index += 1
            if kind == REC_END:
                break
        self.meta = self._read_meta()
        return self.meta
