"""llm.c token shards: a 256-int32 header (:mod:`gputravel.core.protocol.shards`: magic, version, token count),
then the token ids, little-endian ``uint16`` (llm.c's GPT-2 shards) or ``uint32`` (a vocabulary beyond 65,536).
Written for the demo corpus and for a tokenized folder (``hftokenizer``), read back with header, size and
vocabulary checked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gputravel.core.errors import DataError
from gputravel.core.protocol.shards import SHARD_HEADER_BYTES, parse_shard_header, shard_header_bytes
from gputravel.core.training.tokens import GPT2_VOCAB_SIZE, U16_LIMIT, TokenFormat

__all__ = ["LLMC_HEADER_BYTES", "LLMC_MAGIC", "LLMC_VERSION", "read_llmc_shard", "shard_format_for",
           "write_llmc_shard"]

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = SHARD_HEADER_BYTES


def shard_format_for(vocab: int) -> TokenFormat:
    """The shard format a tokenizer of ``vocab`` ids writes: ``u16`` while every id fits (the default, llm.c's
    GPT-2 shards), ``u32`` beyond 65,536. Chosen by the vocabulary, not by the ids one text happens to use,
    so every holder tokenized for one model has the same width."""
    return TokenFormat.U16 if vocab <= U16_LIMIT else TokenFormat.U32


def write_llmc_shard(path: Path, tokens: Sequence[int] | np.ndarray, *, fmt: TokenFormat | str = TokenFormat.U16
                     ) -> None:
    """Write an llm.c token shard: the 256-int32 header (:mod:`gputravel.core.protocol.shards`: magic 20240520
    version 1 for ``u16``, 20240801 version 7 for ``u32``, then the count), then the ids, little-endian."""
    fmt = TokenFormat(fmt)
    if fmt is TokenFormat.BYTE:
        raise DataError(f"{path}: byte tokens are text files, not shards")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: tokens must be one-dimensional")
    limit = U16_LIMIT if fmt is TokenFormat.U16 else 1 << 32
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise DataError(f"{path}: token ids must fit in {'uint16' if fmt is TokenFormat.U16 else 'uint32'}")
    header = shard_header_bytes(fmt.value, int(arr.size))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(arr.astype("<u2" if fmt is TokenFormat.U16 else "<u4").tobytes())
    os.replace(tmp, path)


def _read_llmc_header(path: Path) -> tuple[TokenFormat, int]:
    """Validate a shard's header and size; return its token format and count."""
    try:
        with open(path, "rb") as f:
            raw = f.read(LLMC_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    head = parse_shard_header(raw, size, path)
    return TokenFormat(head.fmt), head.tokens


def read_llmc_shard(path: Path, *, vocab: int = GPT2_VOCAB_SIZE) -> np.ndarray:
    """Tokens of an llm.c shard (``uint16`` or ``uint32``, as its header says); header, size and vocabulary
    (default GPT-2's) are checked.

    Raises:
        DataError: bad magic or version, size mismatch, or token ids beyond the vocabulary.
    """
    fmt, count = _read_llmc_header(path)
    dtype = "<u2" if fmt is TokenFormat.U16 else "<u4"
    tokens = np.fromfile(path, dtype=dtype, offset=LLMC_HEADER_BYTES, count=count)
    if tokens.size and int(tokens.max()) >= vocab:
        raise DataError(f"{path}: token id {int(tokens.max())} is beyond the vocabulary ({vocab})")
    return tokens.astype(np.uint16 if fmt is TokenFormat.U16 else np.uint32, copy=False)
