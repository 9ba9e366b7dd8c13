"""Engine events: facts in the past tense, frozen, with ids and key fingerprints, never key bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    t: float

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    run_id: str
    platform: dict[str, Any]
    holders: tuple[str, ...]
    visits_planned: int


@dataclass(frozen=True, slots=True)
class DeviceAttested(Event):
    device_id: str
    ok: bool
    claims: dict[str, bool]
    sim: bool


@dataclass(frozen=True, slots=True)
class HolderConnected(Event):
    holder: str
    fmt: str
    train_bytes: int
    val_bytes: int
    agent_sha256: str


@dataclass(frozen=True, slots=True)
class HolderStateChanged(Event):
    """connecting -> deploying -> verified(hash) -> ready -> provisioning -> returned / failed / offline."""

    holder: str
    state: str
    detail: str


@dataclass(frozen=True, slots=True)
class ProvisionResumed(Event):
    visit: int
    holder: str
    epoch: int
    resume_from: int
    attempt: int


@dataclass(frozen=True, slots=True)
class PhaseStarted(Event):
    visit: int
    holder: str
    phase: str
    epoch: int


@dataclass(frozen=True, slots=True)
class PhaseCompleted(Event):
    visit: int
    holder: str
    phase: str
    epoch: int
    seconds: float
    outcome: str = "ok"
    nbytes: int = 0
    key_fingerprint: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProvisionProgressed(Event):
    visit: int
    holder: str
    epoch: int
    nbytes: int
    total: int


@dataclass(frozen=True, slots=True)
class ChunkRejected(Event):
    visit: int
    holder: str
    epoch: int
    seq: int | None
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class KeyRotated(Event):
    epoch: int
    fingerprint: str


@dataclass(frozen=True, slots=True)
class TrainingStepped(Event):
    visit: int
    holder: str
    step: int
    losses: tuple[float, ...]
    val_loss: float | None
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class VisitCompleted(Event):
    visit: int
    holder: str
    epoch: int
    report: dict[str, Any]


@dataclass(frozen=True, slots=True)
class VisitFailed(Event):
    visit: int
    holder: str
    epoch: int
    phase: str
    error: str
    code: str


@dataclass(frozen=True, slots=True)
class RunPaused(Event):
    reason: str
    next_phase: str | None


@dataclass(frozen=True, slots=True)
class RunResumed(Event):
    pass


@dataclass(frozen=True, slots=True)
class RunCompleted(Event):
    run_id: str
    visits: int
    failed: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RunFailed(Event):
    run_id: str
    error: str
    code: str
