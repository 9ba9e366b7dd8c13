"""Engine events: facts in the past tense, frozen, with ids and key fingerprints, never key bytes.

The events whose payload a reader acts on (``VisitCompleted`` with its ``VisitSummary``, ``RunCompleted``) are
wire messages too (``core/protocol/wire.py``): a recording's copy is checked field by field when it is read
back (``core/recording.py``: ``event_from_dict``), and a bad one is refused by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gputravel.core.protocol.wire import (
    MAX_U32,
    MAX_U64,
    Bool,
    Float,
    Int,
    Json,
    ListOf,
    MapOf,
    Nested,
    Opt,
    Str,
    WireMessage,
    bounds,
)

_COUNT = Int(0, MAX_U64)
_INDEX = Int(0, MAX_U32)
_SECONDS = Float(0.0)
_LOSS = Opt(Float(nan=True))


@dataclass(frozen=True, slots=True)
class Event:
    t: float = field(metadata=bounds(Float()))

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
class VisitSummary(WireMessage):
    """One visit as the run's report lists it (``VisitRecord.summary()``; ``to_wire()`` is the report's
    ``visits[i]``). Every field has a default: a recording of an older run may hold fewer."""

    visit: int = field(default=0, metadata=bounds(_INDEX))
    round: int = field(default=0, metadata=bounds(_INDEX))
    holder: str = field(default="", metadata=bounds(Str(128)))
    part: str = field(default="1/1", metadata=bounds(Str(32)))
    epoch: int = field(default=0, metadata=bounds(_INDEX))
    key_fingerprint: str | None = field(default=None, metadata=bounds(Opt(Str(64))))
    bytes: int = field(default=0, metadata=bounds(_COUNT))
    chunks: int = field(default=0, metadata=bounds(_COUNT))
    provision_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    provision_mb_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    train_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    #: None: not said (a recording that lists only some fields)
    integrity_ok: bool | None = field(default=None, metadata=bounds(Opt(Bool())))
    scrub_verified: bool | None = field(default=None, metadata=bounds(Opt(Bool())))
    loss_first: float | None = field(default=None, metadata=bounds(_LOSS))
    loss_last: float | None = field(default=None, metadata=bounds(_LOSS))
    val_loss: float | None = field(default=None, metadata=bounds(_LOSS))
    tokens_per_s: float = field(default=0.0, metadata=bounds(_SECONDS))
    outcome: str = field(default="pending", metadata=bounds(Str(32)))
    error: str | None = field(default=None, metadata=bounds(Opt(Str(1 << 16))))
    failed_phase: str | None = field(default=None, metadata=bounds(Opt(Str(32))))
    rejected: dict[str, int] = field(default_factory=dict, metadata=bounds(MapOf(_COUNT, max_len=64)))
    retransmits: int = field(default=0, metadata=bounds(_COUNT))
    attempts: int = field(default=0, metadata=bounds(_COUNT))
    earlier_failures: list[str] = field(default_factory=list,
                                        metadata=bounds(ListOf(Str(1 << 16), max_len=1024)))
    attack: bool = field(default=False, metadata=bounds(Bool()))
    attack_attempts: dict[str, int] = field(default_factory=dict, metadata=bounds(MapOf(_COUNT, max_len=64)))
    phase_s: dict[str, float] = field(default_factory=dict, metadata=bounds(MapOf(_SECONDS, max_len=32)))
    #: the holder's own verdict (``Verdict.report()``; None: the holder does not attest)
    holder_attestation: dict[str, Any] | None = field(
        default=None, metadata=bounds(Opt(Json(max_depth=8, max_items=1 << 16, max_str=1 << 20))))
    #: the hand-off's fixed cost by stage (window, attest, verdict, admission, ring_bind, first_chunk, done,
    #: total, data), ms; and whether the holder's attestation was fetched ahead while the last visit trained
    handoff_fixed_ms: dict[str, float] = field(default_factory=dict, metadata=bounds(MapOf(Float(), max_len=32)))
    attest_prefetched: bool = field(default=False, metadata=bounds(Bool()))
    #: the device relayed the hand-off on the holder's parked data connection (off its SSH link)
    handoff_relayed: bool = field(default=False, metadata=bounds(Bool()))


@dataclass(frozen=True, slots=True)
class VisitCompleted(Event, WireMessage):
    visit: int = field(metadata=bounds(_INDEX))
    holder: str = field(metadata=bounds(Str(128)))
    epoch: int = field(metadata=bounds(_INDEX))
    report: VisitSummary = field(metadata=bounds(Nested(VisitSummary)))


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
class RunCompleted(Event, WireMessage):
    run_id: str = field(metadata=bounds(Str(64)))
    visits: int = field(metadata=bounds(_COUNT))
    failed: int = field(metadata=bounds(_COUNT))
    seconds: float = field(metadata=bounds(_SECONDS))


@dataclass(frozen=True, slots=True)
class RunFailed(Event):
    run_id: str
    error: str
    code: str


def event_types() -> dict[str, type[Event]]:
    """Every event class by its ``kind`` (what a recording stores), for reading events back."""
    found: dict[str, type[Event]] = {}
    todo: list[type[Event]] = [Event]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found
