"""llm.c token shards' header: which token width a shard holds, checked against the file's real length.

Standard library only: the holder agent, ``data check`` and the run's own reader share it. A shard is a header
of 256 little-endian int32s (magic, version, token count, then zeros) followed by the tokens. The (magic,
version) pair is the versioned field that names the token width, as llm.c itself writes it:

- ``20240520`` version 1: ``uint16`` ids (GPT-2's shards; any vocabulary up to 65,536), format ``u16``;
- ``20240801`` version 7: ``uint32`` ids (llm.c's Llama 3 shards; any larger vocabulary), format ``u32``.

So llm.c's own Llama 3 shards are read as they are, and a reader that knows only the first kind refuses the
second by its magic instead of reading its ids as pairs of 16-bit halves.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gputravel.core.protocol.errors import DataError

__all__ = ["SHARD_HEADER_BYTES", "SHARD_HEADERS", "TOKEN_BYTES", "ShardHeader", "parse_shard_header",
           "shard_header_bytes"]

#: bytes of the header (256 int32s)
SHARD_HEADER_BYTES = 256 * 4
#: bytes one token takes in each token format (``byte``: a .txt file's bytes)
TOKEN_BYTES = {"byte": 1, "u16": 2, "u32": 4}
#: (magic, version) -> token format of the ids that follow
SHARD_HEADERS = {(20240520, 1): "u16", (20240801, 7): "u32"}
_BY_FORMAT = {fmt: pair for pair, fmt in SHARD_HEADERS.items()}


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """A checked header: the ids' format and how many there are."""

    fmt: str  # "u16" or "u32"
    tokens: int

    @property
    def payload_bytes(self) -> int:
        return self.tokens * TOKEN_BYTES[self.fmt]


def shard_header_bytes(fmt: str, tokens: int) -> bytes:
    """The header of a shard of ``tokens`` ids in ``fmt`` (``u16`` or ``u32``)."""
    pair = _BY_FORMAT.get(fmt)
    if pair is None:
        raise DataError(f"no llm.c shard format for {fmt!r} tokens (choose {' or '.join(_BY_FORMAT)})")
    if not 0 <= tokens < 1 << 31:
        raise DataError(f"a shard holds 0 to 2^31-1 tokens, not {tokens}")
    return struct.pack("<3i", *pair, tokens) + bytes(SHARD_HEADER_BYTES - 12)


def parse_shard_header(head: bytes, size: int, where: object) -> ShardHeader:
    """Check a shard's header (its first :data:`SHARD_HEADER_BYTES` bytes) against the file's real ``size``.

    Raises:
        DataError: naming ``where``: shorter than a header, an unknown magic or version, or a token count that
            disagrees with the file's length for that width.
    """
    if len(head) < SHARD_HEADER_BYTES:
        raise DataError(f"{where}: not an llm.c shard (shorter than the {SHARD_HEADER_BYTES}-byte header)")
    magic, version, count = struct.unpack_from("<3i", head)
    fmt = SHARD_HEADERS.get((magic, version))
    if fmt is None:
        known = ", ".join(f"{m} v{v} ({f})" for (m, v), f in SHARD_HEADERS.items())
        raise DataError(f"{where}: not a known llm.c shard (magic {magic}, version {version}; known: {known})")
    width = TOKEN_BYTES[fmt]
    if count < 0 or size != SHARD_HEADER_BYTES + width * count:
        raise DataError(f"{where}: header says {count} tokens ({fmt}) but the file holds "
                        f"{(size - SHARD_HEADER_BYTES) / width:g} (file size {size})")
    return ShardHeader(fmt, count)
