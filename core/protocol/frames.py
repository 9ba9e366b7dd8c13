"""Length-prefixed frames: a fixed prefix, a JSON header and a raw payload.

Wire layout (big endian)::

    magic "GT" | version u8 | type u8 | header_len u16 | payload_len u32 | header (UTF-8 JSON object) | payload

Decoding is strict: bad magic or version, an unknown type, a header or payload over the limits,
a header nested deeper than ``wirejson.MAX_JSON_DEPTH``, a header that is not a JSON object, and a
stream that ends inside a frame are all ``FrameError``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, BinaryIO

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.wirejson import loads_object

MAGIC = b"GT"
VERSION = 1
PREFIX = struct.Struct(">2sBBHI")
MAX_HEADER = 16 * 1024
#: Largest payload a decoder accepts by default: a 16 MiB chunk plus its tag and some slack.
MAX_PAYLOAD = 16 * 1024 * 1024 + 4096
#: The hard maximum size of one frame on the wire.
MAX_FRAME = PREFIX.size + MAX_HEADER + MAX_PAYLOAD


class FrameType(IntEnum):
    """Every frame type on every link. Anything else is rejected."""

    # holder link (orchestrator <-> agent) and data path (agent -> device)
    HELLO = 1
    HANDOFF = 2
    CHUNK = 3
    ACK = 4
    DONE = 5
    ERROR = 6
    BYE = 7
    PING = 8
    PONG = 9
    ATTEST = 10  # orchestrator -> agent: the CVM's quote and the GPU's evidence for this hand-off
    VERDICT = 11  # agent -> orchestrator: what the holder made of them
    # device link (orchestrator <-> device service)
    ATTEST_REQUEST = 16
    EVIDENCE = 17
    KEX_INIT = 18
    KEX_REPLY = 19
    SEALED = 20
    DATA_OPEN = 21
    DATA_READY = 22
    # inside SEALED
    REQUEST = 32
    RESPONSE = 33


@dataclass(slots=True)
class Frame:
    """One decoded frame."""

    type: FrameType
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""


#: one encoder for every frame header (``json.dumps`` with these options builds a new encoder per call, a
#: quarter of a small header's encoding time; the data path encodes one header per chunk)
_HEADER_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def _encode_header(header: Mapping[str, Any] | None) -> bytes:
    raw = _HEADER_ENCODER.encode(header if type(header) is dict else dict(header or {})).encode()
    if len(raw) > MAX_HEADER:
        raise FrameError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER}-byte limit")
    return raw


def frame_head(ftype: FrameType, header: Mapping[str, Any] | None, payload_len: int,
               *, max_payload: int = MAX_PAYLOAD) -> bytes:
    """Prefix and header of a frame, for writers that send the payload separately (no copy)."""
    if payload_len > max_payload:
        raise FrameError(f"payload of {payload_len} bytes exceeds the {max_payload}-byte limit")
    raw = _encode_header(header)
    return PREFIX.pack(MAGIC, VERSION, int(ftype), len(raw), payload_len) + raw


def encode_ack_batch(batch: list[int], slots: list[int] | None, epoch: int, contiguous: int) -> bytes:
    """The frame ``encode_frame(FrameType.ACK, {"batch", "contiguous", "e"[, "slots"]})`` as the same bytes, built
    without the JSON encoder (the device sends one per few chunks; every value is an int, which its callers
    guarantee: anything else goes through ``encode_frame``; tested byte for byte)."""
    tail = "}" if slots is None else f',"slots":[{",".join(map(str, slots))}]}}'
    raw = f'{{"batch":[{",".join(map(str, batch))}],"contiguous":{contiguous:d},"e":{epoch:d}{tail}'.encode()
    if len(raw) > MAX_HEADER:
        raise FrameError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER}-byte limit")
    return PREFIX.pack(MAGIC, VERSION, int(FrameType.ACK), len(raw), 0) + raw


def encode_frame(ftype: FrameType, header: Mapping[str, Any] | None = None,
                 payload: bytes | bytearray | memoryview = b"", *, max_payload: int = MAX_PAYLOAD) -> bytes:
    """One frame as bytes."""
    return b"".join((frame_head(ftype, header, len(payload), max_payload=max_payload), payload))  # one copy


def _parse_prefix(prefix: bytes, max_payload: int) -> tuple[FrameType, int, int]:
    magic, version, ftype, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version}")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    if hlen > MAX_HEADER:
        raise FrameError(f"header of {hlen} bytes exceeds the {MAX_HEADER}-byte limit")
    if plen > max_payload:
        raise FrameError(f"payload of {plen} bytes exceeds the {max_payload}-byte limit")
    return kind, hlen, plen


#: A chunk header exactly as this project's encoder writes it (``_HEADER_ENCODER``: sorted keys, no spaces): ``{"e",
#: "f"?, "n", "o", "s", "slot"?}``, every value a JSON integer without sign or leading zero (at most 19 digits). The
#: data path reads one per chunk; a match is decoded without ``json`` to exactly what ``json`` gives (the same keys
#: in the same order, the same ints; tested), and anything else goes through ``loads_object`` as before.
_INT = rb"(0|[1-9][0-9]{0,18})"
_CHUNK_HEADER = re.compile(rb'\{"e":' + _INT + rb'(?:,"f":' + _INT + rb')?,"n":' + _INT + rb',"o":' + _INT
                           + rb',"s":' + _INT + rb'(?:,"slot":' + _INT + rb')?\}\Z')


def _parse_header(raw: bytes) -> dict[str, Any]:
    """A peer's header: bounded in size and nesting (``wirejson``), a JSON object, or ``FrameError``."""
    if not raw:
        return {}
    m = _CHUNK_HEADER.match(raw)
    if m is not None:  # the per-chunk header in its canonical form: no JSON decoder, no depth scan
        e, f, n, o, s, slot = m.groups()
        header = {"e": int(e)}
        if f is not None:
            header["f"] = int(f)
        header["n"], header["o"], header["s"] = int(n), int(o), int(s)
        if slot is not None:
            header["slot"] = int(slot)
        return header
    return loads_object(raw, max_bytes=MAX_HEADER, what="header")


def decode_frame(data: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD) -> Frame:
    """Decode exactly one frame; trailing or missing bytes are a ``FrameError``."""
    view = memoryview(data)
    if len(view) < PREFIX.size:
        raise FrameError(f"truncated frame: {len(view)} bytes, prefix needs {PREFIX.size}")
    kind, hlen, plen = _parse_prefix(bytes(view[: PREFIX.size]), max_payload)
    total = PREFIX.size + hlen + plen
    if len(view) < total:
        raise FrameError(f"truncated frame: {len(view)} of {total} bytes")
    if len(view) > total:
        raise FrameError(f"{len(view) - total} trailing bytes after frame")
    header = _parse_header(bytes(view[PREFIX.size: PREFIX.size + hlen]))
    return Frame(kind, header, bytes(view[PREFIX.size + hlen: total]))


class FrameDecoder:
    """Incremental decoder for a byte stream: ``feed`` bytes, get whole frames back."""

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max_payload = max_payload

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= PREFIX.size:
            kind, hlen, plen = _parse_prefix(bytes(self._buf[: PREFIX.size]), self._max_payload)
            total = PREFIX.size + hlen + plen
            if len(self._buf) < total:
                break
            header = _parse_header(bytes(self._buf[PREFIX.size: PREFIX.size + hlen]))
            frames.append(Frame(kind, header, bytes(self._buf[PREFIX.size + hlen: total])))
            del self._buf[:total]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)

    def eof(self) -> None:
        """Declare the end of the stream: bytes left over mean a truncated frame."""
        if self._buf:
            raise FrameError(f"stream ended inside a frame ({len(self._buf)} bytes pending)")


def _read_exact(stream: BinaryIO, n: int, *, at_boundary: bool) -> bytes | None:
    first = stream.read(n)
    if len(first) == n:  # the usual case: one read, no copy
        return bytes(first)
    if not first and at_boundary:
        return None
    chunks = bytearray(first)
    while len(chunks) < n:
        got = stream.read(n - len(chunks))
        if not got:
            if at_boundary and not chunks:
                return None
            raise FrameError(f"truncated frame: stream ended after {len(chunks)} of {n} bytes")
        chunks += got
    return bytes(chunks)


def read_frame(stream: BinaryIO, *, max_payload: int = MAX_PAYLOAD) -> Frame | None:
    """Read one frame from a blocking binary stream; ``None`` on a clean end of stream."""
    prefix = _read_exact(stream, PREFIX.size, at_boundary=True)
    if prefix is None:
        return None
    kind, hlen, plen = _parse_prefix(prefix, max_payload)
    header = _parse_header(_read_exact(stream, hlen, at_boundary=False) or b"") if hlen else {}
    payload = _read_exact(stream, plen, at_boundary=False) if plen else b""
    return Frame(kind, header, payload or b"")


def read_frame_into(stream: BinaryIO, buf: bytearray | Any, *, max_payload: int = MAX_PAYLOAD) -> Frame | None:
    """Like ``read_frame``, but the payload lands in ``buf`` (returned as a memoryview of it, valid
    until the next call): the receive path's zero-extra-copy variant. ``buf`` may be a callable
    ``(payload_len) -> bytearray`` so buffers are sized by the traffic, not preallocated at the maximum."""
    prefix = _read_exact(stream, PREFIX.size, at_boundary=True)
    if prefix is None:
        return None
    kind, hlen, plen = _parse_prefix(prefix, max_payload if callable(buf) else min(max_payload, len(buf)))
    if callable(buf):
        buf = buf(plen)
    header = _parse_header(_read_exact(stream, hlen, at_boundary=False) or b"") if hlen else {}
    view = memoryview(buf)[:plen]
    got = 0
    while got < plen:
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise FrameError(f"truncated frame: stream ended after {got} of {plen} payload bytes")
        got += n
    return Frame(kind, header, view)


def write_frame(stream: BinaryIO, ftype: FrameType, header: Mapping[str, Any] | None = None,
                payload: bytes | bytearray | memoryview = b"") -> None:
    """Write one frame to a blocking binary stream (payload written without a copy)."""
    stream.write(frame_head(ftype, header, len(payload)))
    if len(payload):
        stream.write(payload)


async def read_frame_async(reader: Any, *, max_payload: int = MAX_PAYLOAD) -> Frame | None:
    """Read one frame from an ``asyncio.StreamReader``-like object; ``None`` on clean EOF."""
    import asyncio

    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"truncated frame: stream ended after {len(exc.partial)} prefix bytes") from None
    kind, hlen, plen = _parse_prefix(prefix, max_payload)
    try:
        raw = await reader.readexactly(hlen) if hlen else b""
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"truncated frame: stream ended after {len(exc.partial)} of {exc.expected} bytes") from None
    return Frame(kind, _parse_header(raw), payload)
