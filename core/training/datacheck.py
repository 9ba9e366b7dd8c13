"""The orchestrator-side check of ``--data DIR`` (``gputravel data check``, and every run before it starts).

Bounded whatever it is given: every data file is opened with ``O_NONBLOCK`` and must then be a regular file (a
FIFO, a device or a socket is refused by name, never waited on), and every file is read in chunks of
``CHECK_CHUNK`` bytes (a 4 GiB shard takes no more memory than a small one). llm.c shards' token ids must lie
below the vocabulary (GPT-2's, or the model's with ``vocab``). A holder folder tokenized by ``data fetch
--tokenizer`` holds a ``.tokenizer`` record (the tokenizer.json's SHA-256 and vocabulary); given
``tokenizer_hash``, every shard folder must carry that record with that hash, and shards of the width it
records (``u16``, or ``u32`` for a vocabulary over 65,536).
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Generator
from pathlib import Path

import numpy as np

from gputravel.core.errors import DataError
from gputravel.core.protocol.shards import SHARD_HEADER_BYTES, TOKEN_BYTES, ShardHeader, parse_shard_header
from gputravel.core.training.corpus import HolderDataSpec
from gputravel.core.training.tokens import GPT2_VOCAB_SIZE, TokenFormat, bytes_per_token

__all__ = ["CHECK_CHUNK", "TOKENIZER_RECORD", "read_regular", "validate_data_dir"]

#: bytes read at a time from a data file (the check's memory, whatever the file's size)
CHECK_CHUNK = 16 << 20
#: the record ``data fetch --tokenizer`` leaves in each holder folder (hidden: never taken for data)
TOKENIZER_RECORD = ".tokenizer"


def read_regular(path: Path, *, chunk: int = CHECK_CHUNK, offset: int = 0) -> Generator[bytes, None, None]:
    """``path``'s bytes from ``offset`` in chunks of at most ``chunk``; anything but a regular file is a
    ``DataError`` (opened without blocking, checked on the open descriptor: no race with a swap)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or special file"
            raise DataError(f"{path}: not a regular file ({kind}); data files are regular files")
        os.set_blocking(fd, True)
        pos = offset
        while True:
            try:
                block = os.pread(fd, chunk, pos)
            except OSError as exc:
                raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
            if not block:
                return
            pos += len(block)
            yield block
    finally:
        os.close(fd)


def _check_utf8(path: Path) -> int:
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = 0
    try:
        for block in read_regular(path):
            decoder.decode(block)
            size += len(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} near byte {size + exc.start})") from exc
    return size


def _check_shard(path: Path, vocab: int) -> ShardHeader:
    """An llm.c shard's format and token count; header, size and every id below ``vocab`` checked, chunk by
    chunk (``u16`` or ``u32`` ids, as the header's magic and version say)."""
    blocks = read_regular(path, chunk=SHARD_HEADER_BYTES)
    head = next(blocks, b"")
    blocks.close()
    shard = parse_shard_header(head, os.path.getsize(path), path)
    width = TOKEN_BYTES[shard.fmt]
    seen = 0
    for block in read_regular(path, offset=SHARD_HEADER_BYTES, chunk=CHECK_CHUNK):
        ids = np.frombuffer(block, dtype=f"<u{width}", count=len(block) // width)
        if ids.size and int(ids.max()) >= vocab:
            raise DataError(f"{path}: token id {int(ids.max())} is beyond the vocabulary ({vocab})")
        seen += ids.size
    if seen != shard.tokens:
        raise DataError(f"{path}: changed while it was read ({seen} tokens, the header says {shard.tokens})")
    return shard


def _visible(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if not p.name.startswith("."))
    except OSError as exc:  # e.g. a holder folder this user may not read: named, exit 2, not a traceback
        raise DataError(f"{path}: cannot read the folder ({exc.strerror or exc})") from None


def _check_tokenizer(folder: Path, want: str) -> str:
    """The shard format ``folder``'s tokenizer record names (``u16`` for a record older than ``u32`` shards),
    after checking that the record is there and names the tokenizer ``want``."""
    record = folder / TOKENIZER_RECORD
    try:
        data = json.loads(b"".join(read_regular(record, chunk=1 << 16)).decode()[: 1 << 16])
        got, fmt = data.get("sha256"), data.get("format", TokenFormat.U16.value)
    except DataError:
        got, fmt = None, None
    except (ValueError, AttributeError):
        raise DataError(f"{record}: not a tokenizer record (JSON with sha256)") from None
    if got != want:
        by = f"tokenizer {str(got)[:12]}" if got else "no recorded tokenizer"
        raise DataError(f"{folder}: its shards were tokenized by {by}, the model's tokenizer.json is {want[:12]}: "
                        "tokenize them with data fetch --tokenizer")
    if fmt not in (TokenFormat.U16.value, TokenFormat.U32.value):
        raise DataError(f"{record}: names shard format {fmt!r} (u16 or u32)")
    return str(fmt)


def validate_data_dir(path: Path, *, vocab: int | None = None, tokenizer_hash: str | None = None
                      ) -> list[HolderDataSpec]:
    """Check a ``--data DIR``: one subfolder per holder, each with only ``.txt`` or only ``.bin`` files.

    ``.txt`` files must be non-empty UTF-8 (``byte`` tokens); ``.bin`` files must be valid llm.c shards
    with at least one token, all below ``vocab`` (default GPT-2's), ``u16`` or ``u32`` as each header says and
    one width for the whole folder (and for every folder). With ``tokenizer_hash``,
    shard folders must carry that tokenizer's record and text folders are refused. Hidden entries (names
    starting with ``.``) are ignored.

    Raises:
        DataError: naming the offending path: missing folder, no subfolders, data files outside a
            holder folder, an empty holder folder, a nested folder, another file type, mixed formats,
            a file that is not a regular file, non-UTF-8 text, a bad shard, another tokenizer's shards.
    """
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{root}: not a folder")
    entries = _visible(root)
    stray = [p for p in entries if not p.is_dir() and p.suffix in (".txt", ".bin")]
    if stray:
        raise DataError(f"{stray[0]}: data files must sit in one subfolder per holder, not at the top of {root}")
    folders = [p for p in entries if p.is_dir()]
    if not folders:
        raise DataError(f"{root}: no holder subfolders (expected one folder per holder with .txt or .bin files)")
    specs: list[HolderDataSpec] = []
    for folder in folders:
        files = _visible(folder)
        if not files:
            raise DataError(f"{folder}: empty holder folder")
        for f in files:
            if f.is_dir():
                raise DataError(f"{f}: nested folders are not allowed in a holder folder")
            if f.suffix not in (".txt", ".bin"):
                raise DataError(f"{f}: unsupported file type (only .txt text or .bin llm.c shards)")
        suffixes = {f.suffix for f in files}
        if len(suffixes) > 1:
            raise DataError(f"{folder}: mixes .txt and .bin files; one holder uses one format")
        if suffixes == {".txt"}:
            if tokenizer_hash is not None:
                raise DataError(f"{folder}: holds text, but the model has its own tokenizer: tokenize it with "
                                "data fetch --tokenizer (llm.c shards)")
            nbytes = 0
            for f in files:
                size = _check_utf8(f)
                if size == 0:
                    raise DataError(f"{f}: empty file")
                nbytes += size
            specs.append(HolderDataSpec(folder.name, folder, TokenFormat.BYTE, tuple(files), nbytes, nbytes))
        else:
            recorded = _check_tokenizer(folder, tokenizer_hash) if tokenizer_hash is not None else None
            tokens = 0
            widths: set[str] = set()
            for f in files:
                shard = _check_shard(f, GPT2_VOCAB_SIZE if vocab is None else vocab)
                if shard.tokens == 0:
                    raise DataError(f"{f}: shard holds no tokens")
                widths.add(shard.fmt)
                tokens += shard.tokens
            if len(widths) > 1:
                raise DataError(f"{folder}: mixes u16 and u32 shards; one holder uses one token width")
            fmt = TokenFormat(widths.pop())
            if recorded is not None and fmt.value != recorded:
                raise DataError(f"{folder}: {fmt.value} shards, but its tokenizer record says data fetch --tokenizer "
                                f"wrote {recorded}: tokenize them again")
            specs.append(HolderDataSpec(folder.name, folder, fmt, tuple(files), bytes_per_token(fmt) * tokens,
                                        tokens))
    widths_all = {s.fmt for s in specs if s.fmt is not TokenFormat.BYTE}
    if len(widths_all) > 1:
        raise DataError(f"{root}: holders hold shards of different widths ({', '.join(sorted(widths_all))}); "
                        "one run uses one token format")
    return specs
