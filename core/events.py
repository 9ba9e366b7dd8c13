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
class TrainingProgressed(Event):
    """Steps of a TRAIN that is still running: ``step`` of the visit's ``steps`` are done (1-based count);
    ``losses`` are those of the steps since the last progress event, the last of them ``loss``; ``run_step``
    is the run's step counter after them. ``TrainingStepped`` still closes the phase with every loss."""

    visit: int
    holder: str
    step: int
    steps: int
    loss: float
    tokens_per_s: float
    run_step: int = 0
    losses: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class LossSpiked(Event):
    """A step's loss above ``factor`` times the running mean of the losses before it (``mean``)."""

    visit: int
    holder: str
    run_step: int
    loss: float
    mean: float
    factor: float


@dataclass(frozen=True, slots=True)
class ControlRequested(Event):
    """The operator asked to ``cancel`` or ``pause``; it lands between optimizer steps (or phases, or
    provisioning chunks): until ``RunPaused`` or the cancelled visit's end, the run shows CANCELLING... or
    PAUSING...; ``phase`` is the phase running when it was asked."""

    action: str
    phase: str | None = None


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
class VisitCancelled(Event):
    """The operator's cancel (or SIGTERM) landed in ``phase`` after ``steps`` optimizer steps; the partial
    buffer was scrubbed (``scrub_verified``)."""

    visit: int
    holder: str
    epoch: int
    phase: str | None
    steps: int
    scrub_verified: bool


@dataclass(frozen=True, slots=True)
class RunPaused(Event):
    reason: str
    next_phase: str | None
    #: where inside ``next_phase`` it paused, when it paused mid-phase (``"TRAIN 3/8"``: after step 3 of 8)
    within: str | None = None


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
