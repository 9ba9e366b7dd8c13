"""What a run remembers of each visit (``VisitRecord``) and the report it ends with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gputravel.core.ledger import verify_ledger
from gputravel.core.travel.schedule import VisitPlan

if TYPE_CHECKING:
    from gputravel.core.travel.engine import TravelEngine

__all__ = ["VisitRecord", "build_report"]


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

    def reset_for_retry(self) -> None:
        self.failures.append(f"{self.failed_phase}: {self.error}")
        for name in ("key_fingerprint", "error", "failed_phase", "val_loss"):
            setattr(self, name, None)
        self.bytes = self.chunks = self.retransmits = 0
        self.provision_s = self.train_s = self.tokens_per_s = 0.0
        self.integrity_ok = self.scrub_verified = False
        self.losses, self.rejected, self.phase_s = [], {}, {}
        self.holder_attestation = None
        self.outcome = "pending"

    def to_dict(self) -> dict[str, Any]:
        mb_s = self.bytes / self.provision_s / 1e6 if self.provision_s else 0.0
        return {"visit": self.plan.index, "round": self.plan.round, "holder": self.plan.holder,
                "part": f"{self.plan.part + 1}/{self.plan.parts}", "epoch": self.epoch,
                "key_fingerprint": self.key_fingerprint, "bytes": self.bytes, "chunks": self.chunks,
                "provision_s": round(self.provision_s, 6), "provision_mb_s": round(mb_s, 2),
                "train_s": round(self.train_s, 6), "integrity_ok": self.integrity_ok,
                "scrub_verified": self.scrub_verified,
                "loss_first": self.losses[0] if self.losses else None,
                "loss_last": self.losses[-1] if self.losses else None, "val_loss": self.val_loss,
                "tokens_per_s": round(self.tokens_per_s, 1), "outcome": self.outcome, "error": self.error,
                "failed_phase": self.failed_phase, "rejected": self.rejected, "retransmits": self.retransmits,
                "attempts": self.attempts, "earlier_failures": self.failures,
                "attack": bool(self.attack), "attack_attempts": self.attack,
                "phase_s": {k: round(v, 6) for k, v in self.phase_s.items()},
                "holder_attestation": self.holder_attestation}


def build_report(engine: TravelEngine, *, seconds: float) -> dict[str, Any]:
    """The run's JSON-able report (closes the ledger first, then verifies its chain)."""
    engine.ledger.close()
    verify = verify_ledger(engine.out_dir / "ledger.db")
    visits = [r.to_dict() for r in engine.records]
    trained = [r for r in engine.records if r.losses]
    total_bytes = sum(r.bytes for r in engine.records)
    total_prov = sum(r.provision_s for r in engine.records)
    val = [r.val_loss for r in trained if r.val_loss is not None]
    return {
        "run_id": engine.run_id,
        "platform": {**engine.handle.info.to_dict(), "device": engine.device_info.get("device_name", "?"),
                     "torch_device": engine.device_info.get("device"), "cc_mode": engine.device_info.get("cc_mode")},
        "attestation": {"ok": engine.attestation.get("ok"), "device_id": engine.attestation.get("device_id"),
                        "claims": engine.attestation.get("claims")},
        "holders": [i.to_dict() for i in engine.infos.values()],
        "visits": visits,
        "training": {
            "model_params": engine.device_info.get("params"),
            "steps": engine.step_count,
            "loss_first": trained[0].losses[0] if trained else None,
            "loss_last": trained[-1].losses[-1] if trained else None,
            "val_loss": val[-1] if val else None,
            "val_loss_first": val[0] if val else None,
            "tokens_per_s": round(sum(r.tokens_per_s for r in trained) / len(trained), 1) if trained else None,
            "model_digest": engine.expected_model,
            "loss_curve": [round(loss, 5) for _, loss in engine.loss_history],
            "val_curve": [{"step": st, "holder": h, "val_loss": round(v, 5)} for st, h, v in engine.val_history],
        },
        "provisioning": {"bytes": total_bytes, "seconds": round(total_prov, 6),
                         "data_path": engine.device_info.get("data_path"),
                         "mb_s": round(total_bytes / total_prov / 1e6, 2) if total_prov else None,
                         "chunk_kib": engine.settings.chunk_kib, "rejected": dict(engine.rejected_total),
                         "cipher_engine": engine.device_info.get("cipher_engine"),
                         "cipher_engine_reason": engine.device_info.get("cipher_reason")},
        "ledger": {"path": str(engine.out_dir / "ledger.db"), "verified": verify.ok, "rows": verify.rows,
                   "head": verify.head_hash, "reason": verify.reason},
        "checkpoints": {"dir": str(engine.ckpt.directory), "last_seq": engine.last_good_ckpt},
        "failed_visits": sum(1 for r in engine.records if r.outcome == "failed"),
        "retried_visits": sum(1 for r in engine.records if r.failures),
        "holder_refusals": [{"visit": r.plan.index, "holder": r.plan.holder, "claim": c}
                            for r in engine.records for c in r.holder_refusals],
        "attacks": [{"visit": r.plan.index, "holder": r.plan.holder, "epoch": r.epoch, "attempts": r.attack}
                    for r in engine.records if r.attack],
        "device_restarts": engine.device_restarts,
        "session_rekeys": engine.session_rekeys,
        "control_rotations": engine.client.rotations,
        "seconds": round(seconds, 3),
    }
