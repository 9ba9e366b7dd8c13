"""Sealed streams: a long byte stream (a model's state) as bounded chunks, each sealed on its own.

A stream never travels or rests as one message: :func:`rechunk` cuts any sequence of byte pieces
into chunks of at most ``chunk_size`` bytes, :class:`StreamSealer` seals each under a key of the
stream's own, and :class:`StreamOpener` opens them back in order. One stream is::

    chunk 0 .. n-1   data, exactly ``chunk_size`` bytes each except the last   (final = 0)
    end chunk        a JSON trailer: {"bytes": total, "chunks": n, ...}         (final = 1)

Each sealed chunk is ``ciphertext || 16-byte tag``. The key is HKDF-SHA256 of the run key with the
stream's random salt and the digest of its :class:`StreamHeader`; the nonce is a 4-byte prefix of
that derivation and the chunk index; the AAD binds the header digest, the index and the final flag.
So a chunk moved to another index, another stream, another run or another sequence number fails
its tag; a stream cut short at a chunk boundary has no end chunk (``DataError``); a flipped final
flag fails its tag. A fresh salt per stream means a key (and so a nonce) is never used twice, even
when a checkpoint with the same sequence number is written again after a crash.

Standard library and ``cryptography`` only: the device seals with it and a holder could open it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.protocol.cipher import TAG_LEN
from gputravel.core.protocol.errors import DataError, FrameError, TagError
from gputravel.core.protocol.frames import MAX_PAYLOAD
from gputravel.core.protocol.keys import KEY_LEN, PREFIX_LEN, hkdf
from gputravel.core.protocol.wirejson import loads_bounded

__all__ = [
    "DEFAULT_STREAM_CHUNK",
    "MAX_STREAM_CHUNK",
    "SALT_LEN",
    "StreamHeader",
    "StreamOpener",
    "StreamSealer",
    "open_stream",
    "rechunk",
    "seal_stream",
    "tag_digest",
]

#: Plaintext bytes per chunk unless a stream says otherwise: large enough that AES-GCM runs at full
#: speed, small enough that a device stages only a few of them.
DEFAULT_STREAM_CHUNK = 4 << 20
#: The largest chunk a stream may declare: its sealed form, plus a frame's own header room, stays under
#: the frame payload limit (the limit is a security property: no peer makes another buffer more).
MAX_STREAM_CHUNK = MAX_PAYLOAD - TAG_LEN - 64 * 1024
SALT_LEN = 16
#: the end chunk's trailer (JSON counts and digests) may be this large whatever the chunk size
MAX_TRAILER = 16 * 1024
_AAD = struct.Struct(">8s32sQB")
_AAD_LABEL = b"gtstrm-1"


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """What a stream is: its kind, the run and sequence it belongs to, its salt and chunk size.

    The header travels and rests in the clear (a checkpoint file starts with it); every chunk's AAD
    binds its digest, so altering any field makes every chunk fail."""

    kind: str
    run_id: str
    seq: int
    salt: bytes = field(repr=False)
    chunk_size: int = DEFAULT_STREAM_CHUNK

    def __post_init__(self) -> None:
        if not self.kind or not self.run_id:
            raise FrameError("a stream header needs a kind and a run id")
        if type(self.seq) is not int or self.seq < 0:
            raise FrameError(f"stream seq must be a non-negative integer, got {self.seq!r}")
        if len(self.salt) != SALT_LEN:
            raise FrameError(f"stream salt must be {SALT_LEN} bytes, got {len(self.salt)}")
        if type(self.chunk_size) is not int or not 1 <= self.chunk_size <= MAX_STREAM_CHUNK:
            raise FrameError(f"stream chunk size {self.chunk_size!r} is outside 1..{MAX_STREAM_CHUNK}")

    @classmethod
    def new(cls, *, kind: str, run_id: str, seq: int, chunk_size: int = DEFAULT_STREAM_CHUNK) -> StreamHeader:
        """A header with a fresh random salt (the sealer's side)."""
        return cls(kind=kind, run_id=run_id, seq=seq, salt=os.urandom(SALT_LEN), chunk_size=chunk_size)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_id": self.run_id, "seq": self.seq, "salt": self.salt.hex(),
                "chunk_size": self.chunk_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StreamHeader:
        """Parse a header; anything malformed is a ``FrameError``."""
        try:
            extra = set(data) - {"kind", "run_id", "seq", "salt", "chunk_size"}
            if extra:
                raise FrameError(f"unknown stream header fields: {', '.join(sorted(extra))}")
            return cls(kind=str(data["kind"]), run_id=str(data["run_id"]), seq=data["seq"],
                       salt=bytes.fromhex(str(data["salt"])), chunk_size=data["chunk_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FrameError(f"malformed stream header: {exc}") from None

    def encode(self) -> bytes:
        """The canonical bytes (sorted-key JSON) that the AAD's digest covers."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.sha256(b"gputravel/stream-header/v1\0" + self.encode()).digest()

    def sealed_size(self, plain: int) -> int:
        """Bytes of one sealed chunk holding ``plain`` plaintext bytes."""
        return plain + TAG_LEN

    @property
    def max_sealed(self) -> int:
        """The largest sealed chunk of this stream (a data chunk, or the end chunk's trailer)."""
        return max(self.chunk_size, MAX_TRAILER) + TAG_LEN


def _stream_okm(key: bytes, header: StreamHeader) -> tuple[bytes, bytes]:
    """The stream's own AES key and nonce prefix."""
    if len(key) != KEY_LEN:
        raise FrameError(f"a stream key is {KEY_LEN} bytes, got {len(key)}")
    okm = hkdf(bytes(key), salt=header.salt, info=b"gputravel stream v1|" + header.digest(),
               length=KEY_LEN + PREFIX_LEN)
    return okm[:KEY_LEN], okm[KEY_LEN:]


def _stream_key(key: bytes, header: StreamHeader) -> tuple[AESGCM, bytes]:
    aes_key, prefix = _stream_okm(key, header)
    return AESGCM(aes_key), prefix


def tag_digest(header: StreamHeader, tags: Iterable[bytes]) -> str:
    """SHA-256 (hex) over the header and the chunks' GCM tags, in order: what a party that cannot open
    the chunks (the orchestrator storing a checkpoint) compares with the sealer's own."""
    h = hashlib.sha256(b"gputravel/stream-tags/v1\0" + header.digest())
    for tag in tags:
        h.update(tag)
    return h.hexdigest()


class StreamSealer:
    """Seals the chunks of one stream, in order (index = nonce counter, never reused)."""

    __slots__ = ("header", "_key", "_aead", "_prefix", "_hdr", "index", "bytes", "_done", "_tags")

    def __init__(self, key: bytes, header: StreamHeader) -> None:
        self.header = header
        self._key, self._prefix = _stream_okm(key, header)
        self._aead = AESGCM(self._key)
        self._hdr = header.digest()
        self.index = 0
        self.bytes = 0
        self._done = False
        self._tags = hashlib.sha256(b"gputravel/stream-tags/v1\0" + self._hdr)

    def __repr__(self) -> str:  # never the key
        return f"StreamSealer({self.header.kind!r}, seq={self.header.seq}, index={self.index})"

    def _nonce_aad(self, final: bool) -> tuple[bytes, bytes]:
        return (self._prefix + self.index.to_bytes(8, "big"),
                _AAD.pack(_AAD_LABEL, self._hdr, self.index, 1 if final else 0))

    def _check(self, n: int, limit: int | None = None) -> None:
        if self._done:
            raise FrameError("the stream already ended: no chunk may follow its end chunk")
        if n > (self.header.chunk_size if limit is None else limit):
            raise FrameError(f"chunk of {n} bytes exceeds the stream's {self.header.chunk_size}-byte chunks")

    def seal_into(self, plain: bytes | bytearray | memoryview, out: bytearray | memoryview) -> int:
        """Seal one data chunk into ``out`` (at least ``len(plain) + 16`` bytes); returns the sealed length."""
        n = len(plain)
        self._check(n)
        nonce, aad = self._nonce_aad(False)
        dest = memoryview(out)[: n + TAG_LEN]
        self._aead.encrypt_into(nonce, plain, aad, dest)
        self._tags.update(dest[n:])
        self.index += 1
        self.bytes += n
        return n + TAG_LEN

    def seal_pieces(self, pieces: Iterable[bytes | bytearray | memoryview], slot: Callable[[], memoryview],
                    publish: Callable[[int], None]) -> None:
        """Seal the stream of ``pieces`` as its data chunks without gathering them first: the same chunks, byte
        for byte, as :meth:`seal_into` of each chunk :func:`rechunk` cuts, but each piece is encrypted where it
        lies, straight into its place in the chunk's buffer (no staging copy where a chunk spans pieces, which
        most of a model's state does: its tensors are smaller than a chunk). ``slot()`` gives the buffer of the
        next chunk (at least ``sealed_size(chunk_size)`` bytes: the cipher's ``update_into`` asks 15 bytes of
        room beyond its input, which the tag's place gives); ``publish(n)`` is called once the chunk's ``n``
        sealed bytes and its tag are there. A
        piece is done with before the next is asked for (a staging buffer behind it may be reused). The end
        chunk is :meth:`end`'s."""
        size = self.header.chunk_size
        enc: Any = None  # the current chunk's GCM encryptor
        dest = memoryview(b"")
        fill = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            pos, n = 0, len(view)
            while pos < n:
                if enc is None:
                    self._check(0)
                    dest = slot()
                    nonce, aad = self._nonce_aad(False)
                    enc = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
                    enc.authenticate_additional_data(aad)
                    fill = 0
                take = min(size - fill, n - pos)
                if enc.update_into(view[pos: pos + take], dest[fill:]) != take:  # GCM keeps nothing back
                    raise FrameError("the chunk cipher held bytes back")
                fill += take
                pos += take
                if fill == size:
                    publish(self._finish(enc, dest, fill))
                    enc = None
        if enc is not None:
            publish(self._finish(enc, dest, fill))

    def _finish(self, enc: Any, dest: memoryview, n: int) -> int:
        enc.finalize()
        tag = enc.tag
        dest[n: n + TAG_LEN] = tag
        self._tags.update(tag)
        self.index += 1
        self.bytes += n
        return n + TAG_LEN

    def seal(self, plain: bytes | bytearray | memoryview) -> bytes:
        """Seal one data chunk; returns ``ciphertext || tag``."""
        out = bytearray(len(plain) + TAG_LEN)
        self.seal_into(plain, out)
        return bytes(out)

    def end(self, extra: Mapping[str, Any] | None = None) -> bytes:
        """Seal the end chunk: a trailer with the byte and chunk counts and ``extra`` (e.g. a digest)."""
        trailer = dict(extra or {})
        trailer.update(bytes=self.bytes, chunks=self.index)
        raw = json.dumps(trailer, sort_keys=True, separators=(",", ":")).encode()
        if len(raw) > MAX_TRAILER:
            raise FrameError(f"stream trailer of {len(raw)} bytes is over {MAX_TRAILER}")
        self._check(len(raw), MAX_TRAILER)
        nonce, aad = self._nonce_aad(True)
        sealed = self._aead.encrypt(nonce, raw, aad)
        self._tags.update(sealed[-TAG_LEN:])
        self.index += 1
        self._done = True
        return sealed

    @property
    def tag_digest(self) -> str:
        """:func:`tag_digest` of the chunks sealed so far."""
        return self._tags.hexdigest()


class StreamOpener:
    """Opens the chunks of one stream, strictly in order; names the chunk that fails."""

    __slots__ = ("header", "what", "_aead", "_prefix", "_hdr", "index", "bytes", "trailer")

    def __init__(self, key: bytes, header: StreamHeader, *, what: str = "stream") -> None:
        self.header = header
        self.what = what
        self._aead, self._prefix = _stream_key(key, header)
        self._hdr = header.digest()
        self.index = 0
        self.bytes = 0
        self.trailer: dict[str, Any] | None = None

    def __repr__(self) -> str:  # never the key
        return f"StreamOpener({self.what!r}, index={self.index})"

    def _decrypt(self, sealed: bytes | bytearray | memoryview, final: bool, out: Any = None) -> bytes | None:
        if self.trailer is not None:
            raise TagError(f"{self.what}: chunk {self.index} follows the end chunk")
        n = len(sealed) - TAG_LEN
        if n < 0:
            raise DataError(f"{self.what}: chunk {self.index} is truncated ({len(sealed)} bytes, shorter than a tag)")
        if n > (max(self.header.chunk_size, MAX_TRAILER) if final else self.header.chunk_size):
            raise FrameError(f"{self.what}: chunk {self.index} holds {n} bytes, over the "
                             f"{self.header.chunk_size}-byte chunk size")
        nonce = self._prefix + self.index.to_bytes(8, "big")
        aad = _AAD.pack(_AAD_LABEL, self._hdr, self.index, 1 if final else 0)
        try:
            if out is not None:
                self._aead.decrypt_into(nonce, sealed, aad, out)
                return None
            return self._aead.decrypt(nonce, bytes(sealed), aad)
        except InvalidTag:
            if out is not None:
                memoryview(out).cast("B")[:] = bytes(n)  # no unauthenticated plaintext stays behind
            raise TagError(f"{self.what}: chunk {self.index} failed authentication (altered, moved, truncated "
                           "or sealed under another key)") from None

    def open(self, sealed: bytes | bytearray | memoryview, *, final: bool = False) -> bytes:
        """Open the next chunk; for the end chunk (``final``) returns its raw trailer and records it."""
        plain = self._decrypt(sealed, final)
        assert plain is not None
        if final:
            self._finish(plain)
        else:
            self.index += 1
            self.bytes += len(plain)
        return plain

    def open_into(self, sealed: bytes | bytearray | memoryview, out: bytearray | memoryview) -> int:
        """Open the next data chunk into ``out`` (``len(sealed) - 16`` bytes); returns the plaintext length."""
        n = len(sealed) - TAG_LEN
        self._decrypt(sealed, False, memoryview(out)[: max(n, 0)])
        self.index += 1
        self.bytes += n
        return n

    def _finish(self, raw: bytes) -> None:
        try:
            trailer = loads_bounded(raw, what="trailer")
        except FrameError:
            raise TagError(f"{self.what}: end chunk holds no valid trailer") from None
        if not isinstance(trailer, dict) or trailer.get("bytes") != self.bytes or trailer.get("chunks") != self.index:
            raise TagError(f"{self.what}: end chunk counts {trailer!r} do not match the {self.index} chunks and "
                           f"{self.bytes} bytes opened")
        self.index += 1
        self.trailer = trailer

    def finish(self) -> dict[str, Any]:
        """The trailer; a stream that stopped before its end chunk is a ``DataError`` naming the chunk."""
        if self.trailer is None:
            raise DataError(f"{self.what} is truncated: it ends at chunk {self.index} without its end chunk")
        return self.trailer


def rechunk(pieces: Iterable[bytes | bytearray | memoryview], chunk_size: int) -> Iterator[memoryview]:
    """Cut a sequence of byte pieces into chunks of exactly ``chunk_size`` bytes (the last may be shorter).

    Whole chunks inside a large piece are yielded as views of that piece (no copy); the rest is gathered
    in one staging buffer of ``chunk_size`` bytes. A yielded view is valid until the next one is asked for.
    Nothing is yielded for an empty stream.
    """
    if chunk_size < 1:
        raise FrameError(f"chunk size must be positive, got {chunk_size}")
    stage = bytearray(chunk_size)
    fill = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        pos, n = 0, len(view)
        while pos < n:
            if fill == 0 and n - pos >= chunk_size:
                yield view[pos: pos + chunk_size]
                pos += chunk_size
                continue
            take = min(chunk_size - fill, n - pos)
            stage[fill: fill + take] = view[pos: pos + take]
            fill += take
            pos += take
            if fill == chunk_size:
                yield memoryview(stage)
                fill = 0
    if fill:
        yield memoryview(stage)[:fill]


def seal_stream(key: bytes, header: StreamHeader, pieces: Iterable[bytes | bytearray | memoryview], *,
                trailer: Callable[[], Mapping[str, Any]] | None = None) -> Iterator[bytes]:
    """Every sealed chunk of a stream over ``pieces``, then its end chunk (``trailer()`` is called once the
    pieces are exhausted, so it may report a digest computed along the way)."""
    sealer = StreamSealer(key, header)
    for chunk in rechunk(pieces, header.chunk_size):
        yield sealer.seal(chunk)
    yield sealer.end(trailer() if trailer is not None else None)


def open_stream(key: bytes, header: StreamHeader, sealed: Iterable[bytes | bytearray | memoryview], *,
                what: str = "stream") -> Iterator[bytes]:
    """The plaintext of a sealed stream's data chunks, in order; the last item of ``sealed`` is the end chunk.

    Raises ``TagError`` naming the chunk that fails and ``DataError`` if the stream has no end chunk."""
    opener = StreamOpener(key, header, what=what)
    pending: bytes | bytearray | memoryview | None = None
    for chunk in sealed:
        if pending is not None:
            yield opener.open(pending)
        pending = chunk
    if pending is None:
        opener.finish()
        return
    try:
        opener.open(pending, final=True)
    except TagError:
        # the last chunk is not a valid end chunk: either a data chunk (the stream was cut) or an altered one
        if _probe_data(key, header, pending, opener.index):
            raise DataError(f"{what} is truncated: it ends at chunk {opener.index + 1} without its end chunk") from None
        raise
    opener.finish()


def _probe_data(key: bytes, header: StreamHeader, sealed: bytes | bytearray | memoryview, index: int) -> bool:
    """Whether ``sealed`` opens as data chunk ``index`` (used only to name a truncation precisely)."""
    aead, prefix = _stream_key(key, header)
    try:
        aead.decrypt(prefix + index.to_bytes(8, "big"), bytes(sealed), _AAD.pack(_AAD_LABEL, header.digest(), index, 0))
    except InvalidTag:
        return False
    return True
