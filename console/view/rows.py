"""The rows of the console's view model: a line of the operations log, a holder, a visit's attempt and its
phases, as :class:`~gputravel.console.view.model.RunState` holds them (the screens and the CLI read them)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gputravel.core.phases import VISIT_PHASES
from gputravel.core.travel.holders import HolderState

__all__ = ["HolderView", "OpLine", "PhaseMark", "VisitView", "iso_time"]


@dataclass(slots=True)
class OpLine:
    """One line of the operations log: seconds since the run's first event, who, what; ``wall`` is the
    event's own wall-clock time (epoch seconds), which the CLI prints beside the offset."""

    at: float
    source: str
    text: str
    level: str = "info"  # info | warn | error
    wall: float | None = None

    def render(self) -> str:
        return f"+{self.at:7.2f}s  {self.source:<12} {self.text}"

    def stamped(self) -> str:
        """The line with its ISO 8601 UTC wall-clock time in front (``runs log``, ``replay``)."""
        return f"{iso_time(self.wall)}  {self.render()}" if self.wall is not None else self.render()


def iso_time(t: float) -> str:
    """``2026-11-27T16:06:43.512Z``: ISO 8601, UTC, milliseconds."""
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class HolderView:
    name: str
    state: str = "offline"
    agent_sha256: str | None = None
    fmt: str | None = None
    data_bytes: int = 0
    provisioned: int = 0
    total: int = 0
    mb_s: float | None = None
    visits_done: int = 0
    visits_failed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    error: str | None = None
    log: deque[OpLine] = field(default_factory=lambda: deque(maxlen=500))

    @property
    def state_label(self) -> str:
        if self.state == HolderState.VERIFIED and self.agent_sha256:
            return f"verified({self.agent_sha256[:8]})"
        return self.state


@dataclass(slots=True)
class PhaseMark:
    phase: str
    status: str = "pending"  # pending | running | ok | failed | cancelled
    seconds: float | None = None
    nbytes: int = 0


@dataclass(slots=True)
class VisitView:
    visit: int
    holder: str
    attempt: int = 1  # a failed visit is redone: each attempt is a row of its own
    epoch: int = 0
    phases: dict[str, PhaseMark] = field(default_factory=lambda: {str(p): PhaseMark(str(p)) for p in VISIT_PHASES})
    key_fp: str | None = None
    integrity_ok: bool | None = None
    scrub_verified: bool | None = None
    outcome: str = "running"  # running | done | failed | cancelled
    error: str | None = None
    failed_phase: str | None = None
    mb_s: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    rejected: int = 0
    gpu: int | None = None  # a fleet's visit: the GPU (torchrun rank) that made it
    device: str | None = None  # ... and that GPU's device id

    @property
    def ended(self) -> bool:
        return self.outcome != "running"

    def phases_done(self) -> int:
        return sum(1 for m in self.phases.values() if m.status == "ok")
