"""The orchestrator's side of checkpoints: sealed chunks stored as files, written atomically, read back,
kept or pruned. Torch-free (an import contract holds it): the device's side, a model state turned into
chunks and back, is :mod:`gputravel.core.training.checkpoint`.

The file's format and its reader (``CheckpointFile``) are :mod:`gputravel.core.training.checkpoint_file`'s,
re-exported here. The sealer is whoever holds the run key (:meth:`CheckpointStore.run_key`): in a run, the
device. The orchestrator writes the chunks it is handed without opening them (:meth:`CheckpointStore.writer`)
to a temporary file (0600), fsyncs it, renames it into place and fsyncs the folder, so a kill at any
moment leaves the previous checkpoint intact and never a partial one under a checkpoint's name.
Readers check the file name against the sealed sequence number, the run against the caller's, and
every chunk's tag; a truncated file is a ``DataError`` and an altered one a ``TagError``, each
naming the file and the chunk.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gputravel.core.errors import ConfigError, DataError, FrameError, TagError
from gputravel.core.files import WRITEBACK_BYTES, Writeback, fsync_dir, read_private, storage_error
from gputravel.core.protocol.cipher import TAG_LEN
from gputravel.core.protocol.stream import DEFAULT_STREAM_CHUNK, StreamHeader, StreamOpener
from gputravel.core.training.checkpoint_file import (
    CHECKPOINT_VERSION,
    FILE_NAME,
    REC_DATA,
    REC_END,
    REC_META,
    STREAM_KIND,
    CheckpointFile,
    file_head,
    record_head,
)

__all__ = [
    "CHECKPOINT_VERSION",
    "DEFAULT_KEEP",
    "REC_DATA",
    "REC_END",
    "REC_META",
    "CheckpointFile",
    "CheckpointStore",
    "CheckpointWriter",
    "load_or_create_key",
    "meta_mac",
]

KEY_BYTES = 32
#: checkpoints a store keeps unless told otherwise (``--keep-checkpoints``)
DEFAULT_KEEP = 2
_TMP_PREFIX = ".ckpt-tmp-"


# --- keys --------------------------------------------------------------------------------------------
def meta_mac(run_key: bytes, meta: Mapping[str, Any]) -> str:
    """HMAC-SHA256 under the run's checkpoint key over the canonical JSON of a meta record (without its mac):
    the ledger head and settings digest a resume checks cannot be edited in the file's plaintext record."""
    body = json.dumps({k: v for k, v in meta.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(run_key, b"gputravel/checkpoint-meta/v1|" + body.encode(), hashlib.sha256).hexdigest()


def load_or_create_key(path: Path) -> bytes:
    """The 32-byte checkpoint key at ``path``, created (mode 0600) when missing.

    Raises:
        ConfigError: the existing file is group- or world-accessible, not a regular file, not ours, or
            not 32 bytes.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = os.urandom(KEY_BYTES)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # created concurrently (or a dangling link): read it, after the same checks
            return _read_key(path)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(path.parent)
        return key
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    key = read_private(path, what="checkpoint key")
    if len(key) != KEY_BYTES:
        raise ConfigError(f"checkpoint key {path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key



# --- the store ---------------------------------------------------------------------------------------
class CheckpointWriter:
    """One checkpoint being written: records appended to a private temporary file, published by :meth:`commit`.

    Used as a context manager, an exception (or a kill) before ``commit`` leaves no file under a checkpoint's
    name; the previous checkpoints are untouched. The disk writes the chunks back while more arrive
    (:class:`~gputravel.core.files.Writeback`, every ``writeback`` bytes; 0: only at the fsync), so the fsync
    that makes the checkpoint durable finds most of it on the disk already."""

    def __init__(self, store: CheckpointStore, header: StreamHeader, *, writeback: int = WRITEBACK_BYTES) -> None:
        self.store = store
        self.header = header
        self.path = store.path_for(header.seq)
        self.tmp = store.directory / f"{_TMP_PREFIX}{header.seq:06d}-{os.getpid()}-{os.urandom(4).hex()}"
        self.bytes = 0
        self.chunks = 0
        self._ended = False
        self._tags: list[bytes] = []
        self._file: BinaryIO | None = None
        self._writeback: Writeback | None = None
        try:
            with self._io():
                fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
                self._file = os.fdopen(fd, "wb", buffering=0)
                self._writeback = Writeback(fd, every=writeback)
                self._write(file_head(header))
        except BaseException:
            self.abort()
            raise

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        """The disk refusing a write (full: ``DiskFullError``, else ``StorageError``) is the run's named error;
        the caller aborts, which removes the temporary file: the checkpoints before are untouched."""
        try:
            yield
        except OSError as exc:
            raise storage_error(exc, f"checkpoint {self.path.name} in {self.store.directory}") from exc

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self.abort()

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        assert self._file is not None
        view = memoryview(data)
        while view:
            n = self._file.write(view) or 0
            view = view[n:]
            if self._writeback is not None:
                self._writeback.wrote(n)

    def add(self, kind: int, sealed: bytes | bytearray | memoryview) -> None:
        """Append one sealed chunk exactly as the sealer produced it (never opened here)."""
        if self._file is None or self._ended:
            raise DataError(f"checkpoint {self.path.name}: no chunk may follow the end chunk")
        if kind not in (REC_DATA, REC_END):
            raise FrameError(f"unknown checkpoint record kind {kind}")
        if len(sealed) > self.header.max_sealed or len(sealed) < TAG_LEN:
            raise FrameError(f"sealed chunk of {len(sealed)} bytes does not fit the stream's chunk size")
        head = record_head(kind, len(sealed))
        assert self._file is not None
        with self._io():
            n = os.writev(self._file.fileno(), (head, sealed))  # one call, no copy of the chunk
            if self._writeback is not None:
                self._writeback.wrote(n)
            if n < len(head) + len(sealed):  # a short write (a signal, a full disk): the rest, in order
                rest = memoryview(head + bytes(sealed))[n:] if n < len(head) else memoryview(sealed)[n - len(head):]
                self._write(rest)
        self._tags.append(bytes(memoryview(sealed)[-TAG_LEN:]))
        self.bytes += len(sealed)
        self.chunks += 1
        self._ended = kind == REC_END

    @property
    def tag_digest(self) -> str:
        """SHA-256 over the header and the written chunks' tags: equals the sealer's when nothing was lost."""
        from gputravel.core.protocol.stream import tag_digest

        return tag_digest(self.header, self._tags)

    def sync(self) -> None:
        """fsync what was written so far (a background checkpoint syncs its chunks before the commit, whose
        own fsync then has only the meta record to write)."""
        if self._file is not None:
            self._stop_writeback()
            with self._io():
                os.fsync(self._file.fileno())

    def _stop_writeback(self) -> None:
        """No more bulk: the writeback thread ends (before an fsync, and before the file is closed)."""
        if self._writeback is not None:
            self._writeback.close()
            self._writeback = None

    def commit(self, meta: Mapping[str, Any] | None = None, *, prune: bool = True) -> Path:
        """Write the meta record, fsync, rename into place, fsync the folder, prune old checkpoints (unless
        ``prune`` is False: a run prunes only once its ledger names the new checkpoint)."""
        if self._file is None:
            raise DataError(f"checkpoint {self.path.name} was already committed or aborted")
        if not self._ended:
            self.abort()
            raise DataError(f"checkpoint {self.path.name} has no end chunk: refusing to publish a partial stream")
        record = {**dict(meta or {}), "tag_digest": self.tag_digest}
        record["mac"] = meta_mac(self.store.run_key(self.header.run_id), record)
        raw = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        self._stop_writeback()
        with self._io():
            self._write(record_head(REC_META, len(raw)) + raw)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self.tmp, self.path)
            fsync_dir(self.store.directory)
        if prune:
            self.store.prune()
        return self.path

    def abort(self) -> None:
        self._stop_writeback()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)


class CheckpointStore:
    """Sealed, rotating checkpoints in one folder (created 0700)."""

    def __init__(self, directory: Path, key: bytes, *, keep: int = DEFAULT_KEEP) -> None:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"a checkpoint key is {KEY_BYTES} bytes, got {len(key)}")
        if keep < 1:
            raise ConfigError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._key = key
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in self.directory.glob(f"{_TMP_PREFIX}*"):  # left by a kill mid-write: never a checkpoint
            stale.unlink(missing_ok=True)

    def __repr__(self) -> str:  # never the key
        return f"CheckpointStore({str(self.directory)!r}, keep={self.keep})"

    def run_key(self, run_id: str) -> bytes:
        """The checkpoint key bound to one run (HKDF of the store key): what the sealer (the device) is given."""
        rid = run_id.encode()
        if not rid or len(rid) > 0xFFFF:
            raise ConfigError("run_id must be 1 to 65535 bytes of UTF-8")
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                    info=b"gputravel/checkpoint/v2|" + rid).derive(self._key)

    def path_for(self, seq: int) -> Path:
        return self.directory / f"ckpt-{seq:06d}.gtc"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """All checkpoints as ``(seq, path)``, oldest first."""
        found = []
        for entry in self.directory.iterdir():
            m = FILE_NAME.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def prune(self, *, protect: int | None = None) -> None:
        """Remove all but the newest ``keep`` checkpoints, never ``protect`` (the one a run's ledger names)."""
        for seq, old in self.checkpoints()[: -self.keep]:
            if seq != protect:
                old.unlink(missing_ok=True)

    def new_header(self, *, run_id: str, seq: int, chunk_size: int = DEFAULT_STREAM_CHUNK) -> StreamHeader:
        if seq < 0:
            raise ConfigError(f"checkpoint seq must be non-negative, got {seq}")
        self.run_key(run_id)  # validates the run id
        return StreamHeader.new(kind=STREAM_KIND, run_id=run_id, seq=seq, chunk_size=chunk_size)

    def writer(self, header: StreamHeader, *, writeback: int = WRITEBACK_BYTES) -> CheckpointWriter:
        """A writer for the sealed chunks of ``header``'s stream (sealed elsewhere, by the run key's holder);
        ``writeback``: bytes between two starts of the disk's writeback (0: all at the fsync)."""
        if header.kind != STREAM_KIND:
            raise ConfigError(f"a checkpoint stream has kind {STREAM_KIND!r}, not {header.kind!r}")
        return CheckpointWriter(self, header, writeback=writeback)

    def open(self, path_or_seq: Path | int, *, run_id: str | None = None) -> CheckpointFile:
        return CheckpointFile(self.path_for(path_or_seq) if isinstance(path_or_seq, int) else Path(path_or_seq),
                              run_id=run_id)

    def meta(self, path_or_seq: Path | int) -> dict[str, Any]:
        """A checkpoint's plaintext meta record (what the orchestrator wrote: digests, epoch, steps)."""
        with self.open(path_or_seq) as f:
            return f.read_meta()

    def verified_meta(self, path_or_seq: Path | int, *, run_id: str) -> dict[str, Any]:
        """The meta record of a checkpoint of ``run_id`` after every chunk was opened and checked in order and
        the record's MAC (under the run key) verified: what a resume builds on. Raises ``TagError`` /
        ``DataError`` naming what failed."""
        for _ in self.chunks(path_or_seq, run_id=run_id):
            pass
        meta = self.meta(path_or_seq)
        want = meta.pop("mac", None)
        if not isinstance(want, str) or not hmac.compare_digest(want, meta_mac(self.run_key(run_id), meta)):
            raise TagError(f"checkpoint {path_or_seq}: its meta record does not verify (altered or unsealed)")
        return meta

    def chunks(self, path_or_seq: Path | int, *, run_id: str | None = None) -> Iterator[bytes]:
        """The plaintext of a checkpoint's data chunks, opened and checked in order (then its trailer)."""
        with self.open(path_or_seq, run_id=run_id) as f:
            opener = StreamOpener(self.run_key(f.header.run_id), f.header, what=f"checkpoint {f.path}")
            for kind, sealed in f.records():
                if kind == REC_END:
                    opener.open(sealed, final=True)
                else:
                    yield opener.open(sealed)
            opener.finish()
