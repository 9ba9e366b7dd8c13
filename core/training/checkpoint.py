"""Sealed checkpoints under AES-256-GCM, written atomically, mode 0600.

Two kinds, told apart by the version byte. Version 2 (``save_device_state``, what the engine writes
every visit) holds the device's own serialised state as it came over the link, never serialised
again, next to a small JSON record (model digest, seq, epoch, steps, note)::

    magic  b"GTCK"          4 bytes
    version                 u8   (2)
    seq                     u64  big-endian
    run_id length           u16  big-endian, then the run id (UTF-8)
    record length           u32  big-endian (sealed JSON record + 16-byte tag)
    record nonce            12 bytes (random)
    state length            u64  big-endian (sealed device state + 16-byte tag)
    state nonce             12 bytes (random)
    sealed record ‖ tag, sealed state ‖ tag

Version 1 (``save``: any ``torch.save``-able state, e.g. a trainer's ``state_dict``)::

    magic  b"GTCK"          4 bytes
    version                 u8   (1)
    seq                     u64  big-endian
    run_id length           u16  big-endian, then the run id (UTF-8)
    ciphertext length       u64  big-endian (ciphertext + 16-byte tag)
    nonce                   12 bytes (random)
    ciphertext ‖ tag

In both, the whole header is the AAD of every sealed part, so ``run_id``, ``seq`` and the version are authenticated and a file
renamed to another sequence number is detected. The sealing key is derived per run with
HKDF-SHA256 from the store key (``info = "gputravel/checkpoint/v1|" + run_id``), so a random 96-bit
nonce per file is far inside its safe range.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, cast

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gputravel.core.errors import ConfigError, DataError, TagError
from gputravel.core.files import fsync_dir, read_private, write_atomic

__all__ = ["CHECKPOINT_VERSION", "CheckpointStore", "load_or_create_key"]

CHECKPOINT_VERSION = 1
DEVICE_STATE_VERSION = 2
KEY_BYTES = 32
_MAGIC = b"GTCK"
_FIXED = struct.Struct(">4sBQH")  # magic, version, seq, run_id length
_TAIL = struct.Struct(">Q12s")  # ciphertext length, nonce
_TAIL2 = struct.Struct(">I12sQ12s")  # sealed record length, its nonce, sealed state length, its nonce
_NAME = re.compile(r"^ckpt-(\d{6,})\.gtc$")
_TAG_BYTES = 16
_MAX_SEALED = 2**31 - 1 - _TAG_BYTES


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


class CheckpointStore:
    """Sealed, rotating checkpoints in one folder (created 0700)."""

    def __init__(self, directory: Path, key: bytes, *, keep: int = 3) -> None:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"a checkpoint key is {KEY_BYTES} bytes, got {len(key)}")
        if keep < 1:
            raise ConfigError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._key = key
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def __repr__(self) -> str:  # never the key
        return f"CheckpointStore({str(self.directory)!r}, keep={self.keep})"

    def _run_key(self, run_id: str) -> AESGCM:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                    info=b"gputravel/checkpoint/v1|" + run_id.encode())
        return AESGCM(hkdf.derive(self._key))

    def path_for(self, seq: int) -> Path:
        return self.directory / f"ckpt-{seq:06d}.gtc"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """All checkpoints as ``(seq, path)``, oldest first."""
        found = []
        for entry in self.directory.iterdir():
            m = _NAME.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, state: dict[str, Any], *, run_id: str, seq: int) -> Path:
        """Seal ``state`` as checkpoint ``seq`` of ``run_id``; keeps the newest ``keep`` files."""
        rid = self._check_ids(run_id, seq)
        raw = io.BytesIO()
        torch.save(state, raw)
        plaintext = raw.getbuffer()
        if len(plaintext) > _MAX_SEALED:
            raise ConfigError(f"checkpoint state is {len(plaintext)} bytes; one sealed file holds at most "
                              f"{_MAX_SEALED} (AES-GCM in cryptography takes < 2 GiB per message)")
        nonce = os.urandom(12)
        header = (_FIXED.pack(_MAGIC, CHECKPOINT_VERSION, seq, len(rid)) + rid
                  + _TAIL.pack(len(plaintext) + _TAG_BYTES, nonce))
        sealed = self._run_key(run_id).encrypt(nonce, bytes(plaintext), header)
        path = self.path_for(seq)
        write_atomic(path, header + sealed)
        self._prune()
        return path

    def save_device_state(self, blob: bytes | bytearray | memoryview, record: dict[str, Any], *, run_id: str,
                          seq: int) -> Path:
        """Seal the device's serialised state ``blob`` as it is (no second serialisation) with ``record``
        (JSON: model digest, epoch, steps, ...) as checkpoint ``seq`` of ``run_id``."""
        rid = self._check_ids(run_id, seq)
        if len(blob) > _MAX_SEALED:
            raise ConfigError(f"device state is {len(blob)} bytes; one sealed part holds at most {_MAX_SEALED} "
                              f"(AES-GCM in cryptography takes < 2 GiB per message)")
        meta = json.dumps(record, sort_keys=True).encode()
        meta_nonce, state_nonce = os.urandom(12), os.urandom(12)
        header = (_FIXED.pack(_MAGIC, DEVICE_STATE_VERSION, seq, len(rid)) + rid
                  + _TAIL2.pack(len(meta) + _TAG_BYTES, meta_nonce, len(blob) + _TAG_BYTES, state_nonce))
        out = bytearray(len(header) + len(meta) + len(blob) + 2 * _TAG_BYTES)
        out[: len(header)] = header
        view = memoryview(out)
        aead = self._run_key(run_id)
        at = len(header)
        aead.encrypt_into(meta_nonce, meta, header, view[at: at + len(meta) + _TAG_BYTES])
        at += len(meta) + _TAG_BYTES
        aead.encrypt_into(state_nonce, blob, header, view[at:])  # straight into the file's buffer
        path = self.path_for(seq)
        write_atomic(path, cast(bytes, out))  # it writes through a memoryview: any buffer will do
        self._prune()
        return path

    def load_device_state(self, path_or_seq: Path | int, *, run_id: str | None = None
                          ) -> tuple[dict[str, Any], bytes | bytearray]:
        """Verify and open a checkpoint written by ``save_device_state``: ``(record, device state bytes)``.
        A version-1 checkpoint holding a ``device_state`` tensor (written before version 2) reads too."""
        path, version, parts = self._open(path_or_seq, run_id)
        if version == DEVICE_STATE_VERSION:
            return json.loads(bytes(parts[0])), parts[1]
        state = _unpickle(parts[0])
        blob = state.pop("device_state", None)
        if not isinstance(blob, torch.Tensor):
            raise DataError(f"checkpoint {path} holds no device state")
        return state, blob.numpy().tobytes()

    def _check_ids(self, run_id: str, seq: int) -> bytes:
        if seq < 0:
            raise ConfigError(f"checkpoint seq must be non-negative, got {seq}")
        rid = run_id.encode()
        if not rid or len(rid) > 0xFFFF:
            raise ConfigError("run_id must be 1 to 65535 bytes of UTF-8")
        return rid

    def _prune(self) -> None:
        for _, old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)

    def load(self, path_or_seq: Path | int, *, run_id: str | None = None) -> dict[str, Any]:
        """Verify and open a checkpoint (a version-2 one as its record plus ``device_state`` bytes).

        Args:
            path_or_seq: a file, or a sequence number in this store.
            run_id: when given, the checkpoint must belong to this run.

        Raises:
            DataError: missing or truncated file.
            TagError: the file was altered, sealed under another key, renamed, or belongs to another run.
        """
        _, version, parts = self._open(path_or_seq, run_id)
        if version == DEVICE_STATE_VERSION:
            return {**json.loads(bytes(parts[0])), "device_state": parts[1]}
        return _unpickle(parts[0])

    def _open(self, path_or_seq: Path | int, run_id: str | None) -> tuple[Path, int, list[bytes | bytearray]]:
        """Read, check and decrypt one file: (path, version, its plaintext parts)."""
        path = self.path_for(path_or_seq) if isinstance(path_or_seq, int) else Path(path_or_seq)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"checkpoint {path} does not exist") from None
        if len(blob) < _FIXED.size:
            raise DataError(f"checkpoint {path} is truncated ({len(blob)} bytes, header incomplete)")
        magic, version, seq, rid_len = _FIXED.unpack_from(blob)
        if magic != _MAGIC:
            raise TagError(f"{path} is not a sealed gputravel checkpoint (bad magic)")
        if version not in (CHECKPOINT_VERSION, DEVICE_STATE_VERSION):
            raise DataError(f"checkpoint {path} has format version {version}, this build reads "
                            f"{CHECKPOINT_VERSION} and {DEVICE_STATE_VERSION}")
        tail = _TAIL if version == CHECKPOINT_VERSION else _TAIL2
        header_len = _FIXED.size + rid_len + tail.size
        if len(blob) < header_len:
            raise DataError(f"checkpoint {path} is truncated ({len(blob)} bytes, header incomplete)")
        if version == CHECKPOINT_VERSION:
            ct_len, nonce = _TAIL.unpack_from(blob, _FIXED.size + rid_len)
            sealed = [(ct_len, nonce)]
        else:
            meta_len, meta_nonce, state_len, state_nonce = _TAIL2.unpack_from(blob, _FIXED.size + rid_len)
            sealed = [(meta_len, meta_nonce), (state_len, state_nonce)]
        body = memoryview(blob)[header_len:]
        want = sum(n for n, _ in sealed)
        if len(body) < want:
            raise DataError(f"checkpoint {path} is truncated: {len(body)} of {want} sealed bytes present")
        if len(body) > want:
            raise TagError(f"checkpoint {path} has {len(body) - want} unexpected trailing bytes")
        try:
            sealed_run = blob[_FIXED.size: _FIXED.size + rid_len].decode()
        except UnicodeDecodeError:
            raise TagError(f"checkpoint {path}: run id is not UTF-8 (altered header)") from None
        aead = self._run_key(sealed_run)
        header = blob[:header_len]
        parts: list[bytes | bytearray] = []
        at = 0
        for n, nonce in sealed:
            if n < _TAG_BYTES:
                raise TagError(f"checkpoint {path} failed authentication (a sealed part shorter than its tag)")
            out = bytearray(n - _TAG_BYTES)
            try:
                aead.decrypt_into(nonce, body[at: at + n], header, out)
            except InvalidTag:
                raise TagError(f"checkpoint {path} failed authentication (altered, or sealed under another key)"
                               ) from None
            parts.append(out)
            at += n
        m = _NAME.match(path.name)
        if m and int(m.group(1)) != seq:
            raise TagError(f"checkpoint {path} was sealed as seq {seq}; the file was renamed")
        if run_id is not None and sealed_run != run_id:
            raise TagError(f"checkpoint {path} belongs to run {sealed_run!r}, not {run_id!r}")
        return path, version, parts


def _unpickle(plaintext: bytes | bytearray) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(plaintext), map_location="cpu", weights_only=True)
    return state
