"""What a run remembers of each visit (``VisitRecord``) and where its walk stands (``Itinerary``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gputravel.core.events import VisitSummary
from gputravel.core.phases import Phase
from gputravel.core.travel.schedule import VisitPlan

__all__ = ["Itinerary", "VisitRecord"]


@dataclass
class VisitRecord:
    plan: VisitPlan
    epoch: int = 0
    key_fingerprint: str | None = None
    bytes: int = 0
    chunks: int = 0
    provision_s: float = 0.0
    train_s: float = 0.0
    integrity_ok: bool = False
    scrub_verified: bool = False
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    tokens_per_s: float = 0.0
    outcome: str = "pending"
    error: str | None = None
    failed_phase: str | None = None
    rejected: dict[str, int] = field(default_factory=dict)
    retransmits: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    attack: dict[str, int] = field(default_factory=dict)
    #: the holder's own verdict on the CVM and the GPU for this visit (``Verdict.report()``; None: the holder
    #: does not attest); with several keys a visit, the last one, ``ms`` summed
    holder_attestation: dict[str, Any] | None = None
    #: the claims holders refused this visit on, every attempt (a refused visit took no key)
    holder_refusals: list[str] = field(default_factory=list)
    #: the hand-off's fixed cost by stage, ms (``handoff.fixed_stages``: window, attest, verdict, admission,
    #: ring_bind, first_chunk, total), summed over the visit's keys; empty until its first window closed
    handoff_fixed_ms: dict[str, float] = field(default_factory=dict)
    #: the holder's verdict for the visit's (first) key came while the visit before trained
    attest_prefetched: bool = False
    #: the device relayed the visit's (first) HANDOFF on the holder's parked data connection
    handoff_relayed: bool = False

    def reset_for_retry(self) -> None:
        self.failures.append(f"{self.failed_phase}: {self.error}")
        for name in ("key_fingerprint", "error", "failed_phase", "val_loss"):
            setattr(self, name, None)
        self.bytes = self.chunks = self.retransmits = 0
        self.provision_s = self.train_s = self.tokens_per_s = 0.0
        self.integrity_ok = self.scrub_verified = False
        self.losses, self.rejected, self.phase_s = [], {}, {}
        self.holder_attestation = None
        self.handoff_fixed_ms = {}
        self.attest_prefetched = False
        self.handoff_relayed = False
        self.outcome = "pending"

    def summary(self) -> VisitSummary:
        """The visit as the report lists it and ``VisitCompleted`` carries it."""
        mb_s = self.bytes / self.provision_s / 1e6 if self.provision_s else 0.0
        return VisitSummary(
            visit=self.plan.index, round=self.plan.round, holder=self.plan.holder,
            part=f"{self.plan.part + 1}/{self.plan.parts}", epoch=self.epoch,
            key_fingerprint=self.key_fingerprint, bytes=self.bytes, chunks=self.chunks,
            provision_s=round(self.provision_s, 6), provision_mb_s=round(mb_s, 2),
            train_s=round(self.train_s, 6), integrity_ok=self.integrity_ok, scrub_verified=self.scrub_verified,
            loss_first=self.losses[0] if self.losses else None,
            loss_last=self.losses[-1] if self.losses else None, val_loss=self.val_loss,
            tokens_per_s=round(self.tokens_per_s, 1), outcome=self.outcome, error=self.error,
            failed_phase=self.failed_phase, rejected=dict(self.rejected), retransmits=self.retransmits,
            attempts=self.attempts, earlier_failures=list(self.failures),
            attack=bool(self.attack), attack_attempts=dict(self.attack),
            phase_s={k: round(v, 6) for k, v in self.phase_s.items()},
            holder_attestation=self.holder_attestation,
            handoff_fixed_ms=dict(self.handoff_fixed_ms), attest_prefetched=self.attest_prefetched,
            handoff_relayed=self.handoff_relayed)

    def to_dict(self) -> dict[str, Any]:
        """The report's ``visits[i]``."""
        return self.summary().to_wire()


@dataclass
class Itinerary:
    """The run's visits: one record per planned visit, in order, the one being walked and its phase."""

    records: list[VisitRecord] = field(default_factory=list)
    current: VisitRecord | None = None
    phase: Phase | None = None
