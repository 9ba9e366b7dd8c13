"""The device's answers, typed: one frozen dataclass per operation whose fields a caller reads.

Part of the wire protocol (standard library only) and shared by both ends: the device service builds each
answer's header with ``to_wire()``, the orchestrator's client (``core/deviceclient/``) reads it back with
``from_wire()``, which checks every field against its declared bounds (``core/protocol/wire.py``: a field
missing, mistyped or out of bounds is a ``WireFormatError`` naming it); the field names are the wire names
(unchanged). The operations are ``devicelink.Op``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Self

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.holderlink import KeySpec, ProvisioningKey
from gputravel.core.protocol.wire import (
    MAX_U32,
    MAX_U64,
    Bool,
    Float,
    Hex,
    Int,
    ListOf,
    MapOf,
    Opt,
    Str,
    WireMessage,
    bounds,
)

__all__ = ["AesRate", "BufferDigest", "Configured", "DataPathConfig", "DeviceInfo", "DeviceState", "DeviceStats",
           "StreamEnded",
           "HandoffGrant", "Measurement", "ScrubResult", "TrainResult", "WindowClosed", "WindowStatus"]

_SHA256 = Hex(64)
_DIGEST = Hex(64, empty=True)  # a model digest; "" where none was taken
_COUNT = Int(0, MAX_U64)
_EPOCH = Int(0, MAX_U32)
_SECONDS = Float(0.0)
_COUNTS = MapOf(_COUNT, max_len=64)  # rejection codes (or refusal reasons) -> counts
#: the per-step losses of one TRAIN answer (the payload's floats; at most this many steps in one answer)
MAX_LOSSES = 1 << 20
#: the changed epochs one STATS answer lists (``core/device/operations.py``: ``STATS_EPOCHS``)
MAX_STATS_EPOCHS = 64


@dataclass(frozen=True, slots=True)
class DeviceInfo(WireMessage):
    device: str = field(metadata=bounds(Str(64)))
    device_name: str = field(metadata=bounds(Str(256)))
    buffer_bytes: int = field(metadata=bounds(_COUNT))
    cc_mode: str = field(metadata=bounds(Str(32)))
    platform: str = field(metadata=bounds(Str(64)))
    device_id: str = field(metadata=bounds(Str(256)))
    torch: str = field(metadata=bounds(Str(64)))
    #: who opens provisioning chunks: "cpu (cryptography)", "gpu (cuda)", "gpu (simulator)"
    cipher_engine: str = field(default="", metadata=bounds(Str(128)))
    cipher_reason: str = field(default="", metadata=bounds(Str(1024)))  # why that engine ("auto: ...", "set explicitly")
    #: the device process's allocator (core/allocator.py): "keep-freed" or "system", and why
    allocator: str = field(default="", metadata=bounds(Str(32)))
    allocator_reason: str = field(default="", metadata=bounds(Str(1024)))
    #: glibc's heap read back when this answer was made (``malloc_info``; 0 where not glibc): arenas, bytes in
    #: blocks that are mmaps of their own, bytes the heap holds from the system
    malloc_arenas: int = field(default=0, metadata=bounds(_COUNT))
    malloc_mmap_bytes: int = field(default=0, metadata=bounds(_COUNT))
    malloc_heap_bytes: int = field(default=0, metadata=bounds(_COUNT))


@dataclass(frozen=True, slots=True)
class Configured(WireMessage):
    """The code region holds the program whose digest this is; the model has ``params`` parameters."""

    code_digest: str = field(metadata=bounds(_SHA256))
    params: int = field(metadata=bounds(_COUNT))


@dataclass(frozen=True, slots=True)
class Measurement(WireMessage):
    """SHA-256 of the code region, of the model (weights and optimizer state; "" when not asked for), and of
    both; the model's AES-GMAC under the caller's key when one was given (core/device/modelmac.py)."""

    code: str = field(metadata=bounds(_SHA256))
    model: str = field(metadata=bounds(_DIGEST))
    measurement: str = field(metadata=bounds(_SHA256))
    #: seconds the device spent hashing the model for this answer (0 when its digest of this model was reused)
    digest_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    mac: str | None = field(default=None, metadata=bounds(Opt(Hex(max_len=128))))
    mac_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    #: who computed the MAC: "cpu" (in place), "gpu" (the GPU cipher's GHASH), "staged" (host copies)
    mac_engine: str | None = field(default=None, metadata=bounds(Opt(Str(16))))


@dataclass(frozen=True, slots=True)
class HandoffGrant(WireMessage):
    """A provisioning key for one window and one epoch (``repr`` never shows the key).

    On the wire the key is ``ProvisioningKey.to_wire()``'s object (the format is unchanged); ``from_wire``
    types and checks it once: a malformed key, a session id that is not hex, or a fingerprint that is not
    the key's is a ``FrameError``."""

    session_id: str = field(metadata=bounds(Hex(max_len=64)))
    key_fingerprint: str = field(metadata=bounds(Str(64)))
    provisioning_key: ProvisioningKey = field(
        repr=False, metadata=bounds(KeySpec()))
    #: the request carried the window's HANDOFF and the device wrote it on the holder's parked data connection
    relayed: bool = field(default=False, metadata=bounds(Bool()))

    def to_wire(self) -> dict[str, Any]:
        """The header the device always sent; ``relayed`` joins it only when true, so a grant that relayed
        nothing reads the same to an older orchestrator (its absence reads as false)."""
        out = WireMessage.to_wire(self)
        if not self.relayed:
            del out["relayed"]
        return out

    @classmethod
    def from_wire(cls, head: Any, *, where: str | None = None) -> Self:
        grant = cls.checked(head, where=where)
        if grant.key_fingerprint != grant.provisioning_key.fingerprint:
            raise FrameError(f"handoff grant: key_fingerprint {grant.key_fingerprint!r} is not the key's "
                             f"({grant.provisioning_key.fingerprint})")
        return grant


@dataclass(frozen=True, slots=True)
class WindowClosed(WireMessage):
    epoch: int = field(metadata=bounds(_EPOCH))
    bytes: int = field(metadata=bounds(_COUNT))
    chunks: int = field(metadata=bounds(_COUNT))
    expected_chunks: int = field(metadata=bounds(_COUNT))
    contiguous: int = field(metadata=bounds(_COUNT))
    complete: bool = field(metadata=bounds(Bool()))
    rejected: dict[str, int] = field(metadata=bounds(_COUNTS))
    rejected_in_window: dict[str, int] = field(metadata=bounds(_COUNTS))
    #: ns after the window opened when its data connection was ``admitted``, its ring ``ring_bound`` and its
    #: ``first_chunk`` was in device memory (the hand-off's fixed cost by stage; empty from an older device)
    marks_ns: dict[str, int] = field(default_factory=dict, metadata=bounds(MapOf(_COUNT, max_len=16)))


@dataclass(frozen=True, slots=True)
class WindowStatus(WireMessage):
    open: bool = field(metadata=bounds(Bool()))
    epoch: int | None = field(default=None, metadata=bounds(Opt(_EPOCH)))
    contiguous: int = field(default=0, metadata=bounds(_COUNT))
    chunks: int = field(default=0, metadata=bounds(_COUNT))
    bytes: int = field(default=0, metadata=bounds(_COUNT))

    def to_wire(self) -> dict[str, Any]:
        return self.wire_fields() if self.open else {"open": False}


@dataclass(frozen=True, slots=True)
class TrainResult(WireMessage):
    losses: list[float] = field(metadata=bounds(ListOf(Float(nan=True), max_len=MAX_LOSSES)))
    tokens: int = field(metadata=bounds(_COUNT))
    seconds: float = field(metadata=bounds(_SECONDS))
    tokens_per_s: float = field(metadata=bounds(_SECONDS))
    val_loss: float | None = field(metadata=bounds(Opt(Float(nan=True))))
    model_digest: str = field(metadata=bounds(_DIGEST))
    #: the slice ran every step it was asked for (then it validated and hashed); False: cut short by its time
    #: budget, no validation, no digest (``""``)
    done: bool = field(default=True, metadata=bounds(Bool()))

    def header_without_losses(self) -> dict[str, Any]:
        """The wire header; the losses travel as :meth:`losses_payload`, never in the header."""
        head = self.to_wire()
        del head["losses"]
        head["n_losses"] = len(self.losses)
        return head

    def losses_payload(self) -> bytes:
        """The per-step losses as big-endian float64s (8 bytes a step)."""
        return struct.pack(f">{len(self.losses)}d", *self.losses)

    @classmethod
    def from_wire_with_losses(cls, head: dict[str, Any], payload: bytes | bytearray | memoryview) -> TrainResult:
        """Rebuild from a header and the losses payload; a payload that does not hold ``n_losses`` floats is a
        ``FrameError``."""
        n = head.get("n_losses")
        if type(n) is not int or not 0 <= n <= MAX_LOSSES or len(payload) != 8 * n:
            raise FrameError(f"train answer: {len(payload)} payload bytes do not hold {n!r} losses")
        losses = list(struct.unpack(f">{n}d", bytes(payload)))
        return cls.from_wire({**head, "losses": losses})


@dataclass(frozen=True, slots=True)
class ScrubResult(WireMessage):
    verified: bool = field(metadata=bounds(Bool()))
    bytes: int = field(metadata=bounds(_COUNT))
    seconds: float = field(metadata=bounds(_SECONDS))


@dataclass(frozen=True, slots=True)
class DeviceState(WireMessage):
    """The model's digest after a restore (in the current format: the one expected from here on), the seconds the
    device spent hashing, and the digest it checked against the stream's sealed one, in the format the stream
    names (``sealed_format``; equal to ``model_digest`` where that is the current format; "" from a device that
    predates the field)."""

    model_digest: str = field(metadata=bounds(_DIGEST))
    digest_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    sealed_digest: str = field(default="", metadata=bounds(_DIGEST))
    sealed_format: str = field(default="", metadata=bounds(Str(8)))


@dataclass(frozen=True, slots=True)
class StreamEnded(WireMessage):
    """A checkpoint stream's last answer: what the device sealed (the model digest it hashed once, its
    time, and the digest of the chunks' tags the orchestrator compares with what it wrote)."""

    model_digest: str = field(metadata=bounds(_DIGEST))
    tag_digest: str = field(metadata=bounds(_SHA256))
    bytes: int = field(metadata=bounds(_COUNT))
    chunks: int = field(metadata=bounds(_COUNT))
    seconds: float = field(metadata=bounds(_SECONDS))
    digest_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    #: the device's seal alone (the state's pieces and AES-GCM: CPU time), not its waits
    seal_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    #: copying the state in device memory first (a background checkpoint)
    snapshot_s: float = field(default=0.0, metadata=bounds(_SECONDS))


@dataclass(frozen=True, slots=True)
class DeviceStats(WireMessage):
    counters: dict[str, int] = field(metadata=bounds(MapOf(_COUNT, max_len=256)))
    rejected: dict[str, int] = field(metadata=bounds(_COUNTS))
    busy_s: float = field(metadata=bounds(_SECONDS))
    #: only the epochs changed since the ``since`` asked for
    rejected_by_epoch: dict[str, dict[str, int]] = field(metadata=bounds(MapOf(_COUNTS, max_len=MAX_STATS_EPOCHS, key_len=20)))
    memory_bytes: int = field(metadata=bounds(_COUNT))
    epoch: int = field(metadata=bounds(_EPOCH))
    rejection_gen: int = field(default=0, metadata=bounds(_COUNT))  # pass it as ``since`` next time
    more: bool = field(default=False, metadata=bounds(Bool()))  # more changed epochs than one answer lists: ask again
    #: connections refused before authenticating
    refused: dict[str, int] = field(default_factory=dict, metadata=bounds(_COUNTS))


@dataclass(frozen=True, slots=True)
class AesRate(WireMessage):
    bytes_per_s: float = field(metadata=bounds(_SECONDS))
    chunk: int = field(metadata=bounds(_COUNT))
    threads: int = field(metadata=bounds(Int(0, 4096)))


@dataclass(frozen=True, slots=True)
class BufferDigest(WireMessage):
    sha256: str = field(metadata=bounds(_SHA256))
    offset: int = field(metadata=bounds(_COUNT))
    length: int = field(metadata=bounds(_COUNT))


@dataclass(frozen=True, slots=True)
class DataPathConfig(WireMessage):
    parallel_auth: bool = field(metadata=bounds(Bool()))
    overlap: bool = field(metadata=bounds(Bool()))
    workers: int = field(metadata=bounds(Int(0, 4096)))
    reason: str = field(metadata=bounds(Str(1024)))
