"""The device's answers, typed: one frozen dataclass per operation whose fields a caller reads.

Part of the wire protocol (standard library only) and shared by both ends: the device service builds each
answer's header with ``to_wire()``, the orchestrator's client (``core/deviceclient/``) reads it back with
``from_wire()``; the field names are the wire names (unchanged). The operations are ``devicelink.Op``.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.holderlink import ProvisioningKey

__all__ = ["AesRate", "BufferDigest", "Configured", "DataPathConfig", "DeviceInfo", "DeviceState", "DeviceStats",
           "StreamEnded",
           "HandoffGrant", "Measurement", "ScrubResult", "TrainResult", "WindowClosed", "WindowStatus"]


class _Wire:
    """``to_wire``/``from_wire`` for a dataclass whose field names are its header keys."""

    __slots__ = ()

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass
        return wire

    @classmethod
    def from_wire(cls, head: dict[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in head.items() if k in names})


@dataclass(frozen=True, slots=True)
class DeviceInfo(_Wire):
    device: str
    device_name: str
    buffer_bytes: int
    cc_mode: str
    platform: str
    device_id: str
    torch: str
    cipher_engine: str = ""  # who opens provisioning chunks: "cpu (cryptography)", "gpu (cuda)", "gpu (simulator)"
    cipher_reason: str = ""  # why that engine ("auto: ...", "set explicitly")


@dataclass(frozen=True, slots=True)
class Configured(_Wire):
    """The code region holds the program whose digest this is; the model has ``params`` parameters."""

    code_digest: str
    params: int


@dataclass(frozen=True, slots=True)
class Measurement(_Wire):
    """SHA-256 of the code region, of the model (weights and optimizer state; "" when not asked for), and of
    both; the model's AES-GMAC under the caller's key when one was given (core/device/modelmac.py)."""

    code: str
    model: str
    measurement: str
    #: seconds the device spent hashing the model for this answer (0 when its digest of this model was reused)
    digest_s: float = 0.0
    mac: str | None = None
    mac_s: float = 0.0
    #: who computed the MAC: "cpu" (in place), "gpu" (the GPU cipher's GHASH), "staged" (host copies)
    mac_engine: str | None = None


@dataclass(frozen=True, slots=True)
class HandoffGrant(_Wire):
    """A provisioning key for one window and one epoch (``repr`` never shows the key).

    On the wire the key is ``ProvisioningKey.to_wire()``'s object (the format is unchanged); ``from_wire``
    types and checks it once: a malformed key, a session id that is not hex, or a fingerprint that is not
    the key's is a ``FrameError``."""

    session_id: str
    key_fingerprint: str
    provisioning_key: ProvisioningKey = field(repr=False)

    def to_wire(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "key_fingerprint": self.key_fingerprint,
                "provisioning_key": self.provisioning_key.to_wire()}

    @classmethod
    def from_wire(cls, head: dict[str, Any]) -> HandoffGrant:
        session_id, fp = head.get("session_id"), head.get("key_fingerprint")
        if not isinstance(session_id, str) or not session_id or len(session_id) % 2:
            raise FrameError("handoff grant: session_id must be a hex string")
        try:
            bytes.fromhex(session_id)
        except ValueError:
            raise FrameError("handoff grant: session_id must be a hex string") from None
        key = ProvisioningKey.from_wire(head.get("provisioning_key"))
        if fp != key.fingerprint:
            raise FrameError(f"handoff grant: key_fingerprint {fp!r} is not the key's ({key.fingerprint})")
        return cls(session_id=session_id, key_fingerprint=key.fingerprint, provisioning_key=key)


@dataclass(frozen=True, slots=True)
class WindowClosed(_Wire):
    epoch: int
    bytes: int
    chunks: int
    expected_chunks: int
    contiguous: int
    complete: bool
    rejected: dict[str, int]
    rejected_in_window: dict[str, int]
    #: ns after the window opened when its data connection was ``admitted``, its ring ``ring_bound`` and its
    #: ``first_chunk`` was in device memory (the hand-off's fixed cost by stage; empty from an older device)
    marks_ns: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WindowStatus(_Wire):
    open: bool
    epoch: int | None = None
    contiguous: int = 0
    chunks: int = 0
    bytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self) if self.open else {"open": False}


@dataclass(frozen=True, slots=True)
class TrainResult(_Wire):
    losses: list[float]
    tokens: int
    seconds: float
    tokens_per_s: float
    val_loss: float | None
    model_digest: str
    #: the slice ran every step it was asked for (then it validated and hashed); False: cut short by its time
    #: budget, no validation, no digest (``""``)
    done: bool = True

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
        if type(n) is not int or n < 0 or len(payload) != 8 * n:
            raise FrameError(f"train answer: {len(payload)} payload bytes do not hold {n!r} losses")
        losses = list(struct.unpack(f">{n}d", bytes(payload)))
        return cls.from_wire({**head, "losses": losses})


@dataclass(frozen=True, slots=True)
class ScrubResult(_Wire):
    verified: bool
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DeviceState(_Wire):
    """The model's digest after a restore, and the seconds the device spent hashing it."""

    model_digest: str
    digest_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StreamEnded(_Wire):
    """A checkpoint stream's last answer: what the device sealed (the model digest it hashed once, its
    time, and the digest of the chunks' tags the orchestrator compares with what it wrote)."""

    model_digest: str
    tag_digest: str
    bytes: int
    chunks: int
    seconds: float
    digest_s: float = 0.0
    seal_s: float = 0.0  # the device's seal alone (the state's pieces and AES-GCM: CPU time), not its waits
    snapshot_s: float = 0.0  # copying the state in device memory first (a background checkpoint)


@dataclass(frozen=True, slots=True)
class DeviceStats(_Wire):
    counters: dict[str, int]
    rejected: dict[str, int]
    busy_s: float
    rejected_by_epoch: dict[str, dict[str, int]]  # only the epochs changed since the ``since`` asked for
    memory_bytes: int
    epoch: int
    rejection_gen: int = 0  # pass it as ``since`` next time
    more: bool = False  # more changed epochs than one answer lists: ask again
    refused: dict[str, int] = field(default_factory=dict)  # connections refused before authenticating


@dataclass(frozen=True, slots=True)
class AesRate(_Wire):
    bytes_per_s: float
    chunk: int
    threads: int


@dataclass(frozen=True, slots=True)
class BufferDigest(_Wire):
    sha256: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class DataPathConfig(_Wire):
    parallel_auth: bool
    overlap: bool
    workers: int
    reason: str
