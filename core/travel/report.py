"""The report a run ends with, typed (``RunReport``); ``to_json()`` is the JSON-able dict the CLI prints and
every consumer reads (its keys and their order are part of the interface)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gputravel.core.ledger import verify_ledger
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.runfolder.folder import RunFolder
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.holders import HolderInfo
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import Itinerary, VisitRecord

__all__ = ["LedgerSummary", "ProvisioningSummary", "RunReport", "TrainingSummary", "VisitRecord", "build_report"]


@dataclass(frozen=True, slots=True)
class TrainingSummary:
    model_params: Any
    model: Any  # {architecture, params, source, lora}: device_session.model_info
    steps: int
    loss_first: float | None
    loss_last: float | None
    val_loss: float | None
    val_loss_first: float | None
    tokens_per_s: float | None
    model_digest: str | None
    loss_curve: list[float]
    val_curve: list[dict[str, Any]]

    @classmethod
    def of(cls, records: list[VisitRecord], log: TrainingLog, device: DeviceSession) -> TrainingSummary:
        trained = [r for r in records if r.losses]
        val = [r.val_loss for r in trained if r.val_loss is not None]
        return cls(
            model_params=device.device_info.get("params"), model=device.device_info.get("model"),
            steps=log.step_count,
            loss_first=trained[0].losses[0] if trained else None,
            loss_last=trained[-1].losses[-1] if trained else None,
            val_loss=val[-1] if val else None, val_loss_first=val[0] if val else None,
            tokens_per_s=round(sum(r.tokens_per_s for r in trained) / len(trained), 1) if trained else None,
            model_digest=device.expected_model, loss_curve=[round(loss, 5) for _, loss in log.loss_history],
            val_curve=[{"step": st, "holder": h, "val_loss": round(v, 5)} for st, h, v in log.val_history])


@dataclass(frozen=True, slots=True)
class ProvisioningSummary:
    bytes: int
    seconds: float
    data_path: Any
    mb_s: float | None
    chunk_kib: int
    rejected: dict[str, int]
    cipher_engine: Any
    cipher_engine_reason: Any


@dataclass(frozen=True, slots=True)
class LedgerSummary:
    path: str
    verified: bool
    rows: int
    head: str | None
    reason: str | None


@dataclass(slots=True)
class RunReport:
    """What a run did; ``to_json()`` gives the dict of the report (``extra``'s keys after the others: a fleet
    rank's ``gpu``, ``fleet_steps``, ``fleet_plan``)."""

    run_id: str
    platform: dict[str, Any]
    attestation: dict[str, Any]
    holders: list[dict[str, Any]]
    visits: list[dict[str, Any]]
    training: TrainingSummary
    provisioning: ProvisioningSummary
    ledger: LedgerSummary
    checkpoints: dict[str, Any]
    failed_visits: int
    retried_visits: int
    holder_refusals: list[dict[str, Any]]
    attacks: list[dict[str, Any]]
    device_restarts: int
    session_rekeys: int
    control_rotations: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)  # the fields in their order, the summaries as dicts (a copy: the report stays as it is)
        extra = out.pop("extra")
        return {**out, **extra}


def build_report(*, run_id: str, out_dir: Path, chunk_kib: int, handle: DeviceHandle, device: DeviceSession,
                 log: TrainingLog, walk: Itinerary, infos: Mapping[str, HolderInfo], rejected: Counter[str],
                 checkpoints: dict[str, Any], seconds: float) -> RunReport:
    """The run's report (the ledger must be closed: its chain is verified here)."""
    records = walk.records
    ledger_path = RunFolder(out_dir).ledger
    verify = verify_ledger(ledger_path)
    total_bytes = sum(r.bytes for r in records)
    total_prov = sum(r.provision_s for r in records)
    info, att = device.device_info, device.attestation
    return RunReport(
        run_id=run_id,
        platform={**handle.info.to_dict(), "device": info.get("device_name", "?"), "torch_device": info.get("device"),
                  "cc_mode": info.get("cc_mode"), "allocator": info.get("allocator"),
                  "allocator_reason": info.get("allocator_reason")},
        attestation={"ok": att.get("ok"), "device_id": att.get("device_id"), "claims": att.get("claims")},
        holders=[i.to_dict() for i in infos.values()],
        visits=[r.to_dict() for r in records],
        training=TrainingSummary.of(records, log, device),
        provisioning=ProvisioningSummary(
            bytes=total_bytes, seconds=round(total_prov, 6), data_path=info.get("data_path"),
            mb_s=round(total_bytes / total_prov / 1e6, 2) if total_prov else None, chunk_kib=chunk_kib,
            rejected=dict(rejected), cipher_engine=info.get("cipher_engine"),
            cipher_engine_reason=info.get("cipher_reason")),
        ledger=LedgerSummary(str(ledger_path), verify.ok, verify.rows, verify.head_hash, verify.reason),
        checkpoints=checkpoints,
        failed_visits=sum(1 for r in records if r.outcome == "failed"),
        retried_visits=sum(1 for r in records if r.failures),
        holder_refusals=[{"visit": r.plan.index, "holder": r.plan.holder, "claim": c}
                         for r in records for c in r.holder_refusals],
        attacks=[{"visit": r.plan.index, "holder": r.plan.holder, "epoch": r.epoch, "attempts": r.attack}
                 for r in records if r.attack],
        device_restarts=device.restarts, session_rekeys=device.rekeys, control_rotations=device.client.rotations,
        seconds=round(seconds, 3))

