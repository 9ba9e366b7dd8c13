"""The console's view model: the run as an operator sees it, folded from engine events alone.

:class:`RunState` is built from events, so a live run and a replayed recording look the same, and a recorded
run renders identically every time (it keeps event times, never the wall clock). It knows nothing of
Textual: the screens render it, ``gputravel replay`` and ``gputravel runs`` summarise it.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gputravel.console.view.fleet import RUN_EVENTS, TERMINAL_STATUSES, DeviceView, FleetFold, gpu_label
from gputravel.console.view.phase_fold import PhaseFold
from gputravel.console.view.rows import HolderView, OpLine, PhaseMark, VisitView
from gputravel.console.view.training import TrainingFold
from gputravel.core import events as ev
from gputravel.core.phases import VISIT_PHASES, Phase
from gputravel.core.travel.holders import HolderState

__all__ = ["RUN_EVENTS", "TERMINAL_STATUSES", "DeviceView", "HolderView", "OpLine", "PhaseMark",
           "RunState", "VisitView", "gpu_label"]

#: How a holder's refusal reads in a visit's error (``HolderRefusedError``): the claim it refused.
HOLDER_REFUSED = re.compile(r"holder attestation refused: (.+?)(?: \(no key released\))?$")


@dataclass
class RunState:
    """What an operator sees, folded from events by :meth:`apply`."""

    status: str = "idle"  # idle | starting | running | paused | completed | failed | cancelled
    run_id: str | None = None
    platform: dict[str, Any] = field(default_factory=dict)
    sim: bool | None = None
    device_id: str | None = None
    attested: bool | None = None
    claims: dict[str, bool] = field(default_factory=dict)
    holders: dict[str, HolderView] = field(default_factory=dict)
    visits: dict[int, VisitView] = field(default_factory=dict)  # row -> attempt, in the order they ran
    rows: dict[int, int] = field(default_factory=dict)  # visit index -> its latest row
    visits_planned: int = 0
    current_visit: int | None = None
    current_holder: str | None = None
    current_phase: str | None = None
    last_phase: str | None = None
    gpu_at: str = "orchestrator"
    epoch: int = 0
    key_fp: str | None = None
    key_visit: int | None = None  # the visit (0-based) whose provisioning key ``key_fp`` names
    paused_before: str | None = None
    pause_reason: str | None = None
    breakpoints: set[str] = field(default_factory=set)
    loss: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, str, float]] = field(default_factory=list)
    tokens_per_s: float | None = None
    train_progress: tuple[int, int] | None = None  # (step k, of K) of the TRAIN now running
    pending: str | None = None  # "cancel" | "pause": asked, not landed yet (CANCELLING... / PAUSING...)
    spikes: list[tuple[int, float, float]] = field(default_factory=list)  # (run step, loss, running mean)
    rejected_total: Counter[str] = field(default_factory=Counter)
    oplog: deque[OpLine] = field(default_factory=lambda: deque(maxlen=1000))
    error: str | None = None
    error_code: str | None = None
    resumed: int = 0  # times the run went on in the same recording (``run --resume``) after it had ended
    events_seen: int = 0
    phases_completed: int = 0
    t0: float | None = None
    _t: float = 0.0
    #: A fleet (``apply(event, gpu=R)``): each GPU's own run, folded from its events alone; this state is
    #: their merge (holders, visits, log), its status and counts summed up from them.
    gpus: dict[int, RunState] = field(default_factory=dict)
    fleet_size: int = 0  # the GPUs the fleet has (some may not have written an event yet)
    _gpu: int | None = None  # the GPU whose event is being folded
    _fleet_loss: dict[int, list[float]] = field(default_factory=dict)

    # --- folding ------------------------------------------------------------------------------
    def new_gpu_state(self) -> RunState:
        return RunState()

    def seed_holders(self, names: list[str]) -> None:
        for name in names:
            self.holders.setdefault(name, HolderView(name))

    def holder(self, name: str) -> HolderView:
        if name not in self.holders:
            self.holders[name] = HolderView(name)
        return self.holders[name]

    def log(self, t: float, source: str, text: str, level: str = "info") -> None:
        if self.t0 is None:
            self.t0 = t
        if self._gpu is not None:  # a fleet: every line names its GPU
            if source in self.holders:
                text = f"{gpu_label(self._gpu)}: {text}"
            else:
                source = gpu_label(self._gpu) + ("" if source in ("orchestrator", "device") else f" {source}")
        line = OpLine(round(t - self.t0, 2), source, text, level, wall=t)
        self.oplog.append(line)
        if source in self.holders:
            self.holders[source].log.append(line)

    def set_paused(self, phase: str | None, reason: str = "step") -> None:
        """The control state the engine is in (it emits no event when a step ends)."""
        if phase is None:
            self.pending = None if self.pending == "pause" else self.pending  # resumed before the pause landed
            if self.status == "paused":
                self.status = "running"
            self.paused_before = self.pause_reason = None
        elif self.status in ("running", "starting", "paused"):
            self.status = "paused"
            self.paused_before, self.pause_reason = phase, self.pause_reason or reason

    def devices(self) -> tuple[DeviceView, ...]:
        """Each GPU of a fleet, in rank order (empty for a single GPU's run): the fleet fold's cards."""
        return FLEET.devices(self)

    @property
    def folding_gpu(self) -> int | None:
        """The fleet GPU whose event is being folded (None for a single GPU's run): what the folds ask."""
        return self._gpu

    @property
    def fleet(self) -> bool:
        """This state merges a fleet's GPUs."""
        return bool(self.gpus) or self.fleet_size > 0

    def apply(self, event: ev.Event, gpu: int | None = None) -> None:
        """Fold one event; ``gpu``: the fleet GPU (torchrun rank) whose recording it comes from."""
        if gpu is not None:
            FLEET.apply(self, event, gpu)
            return
        self.events_seen += 1
        self._t = event.t
        handler = HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)
        else:  # events this view does not know yet still reach the log
            holder = event.to_dict().get("holder")
            if holder:
                self.log(event.t, str(holder), event.kind)

    def _on_DeviceAttested(self, e: ev.DeviceAttested) -> None:
        if self.status == "idle":
            self.status = "starting"
        self.device_id, self.attested, self.claims, self.sim = e.device_id, e.ok, dict(e.claims), e.sim
        self.log(e.t, "device", f"attested {e.device_id}: {'ok' if e.ok else 'FAILED'}{' (SIM)' if e.sim else ''}",
                 "info" if e.ok else "error")

    def _on_HolderConnected(self, e: ev.HolderConnected) -> None:
        h = self.holder(e.holder)
        h.state, h.agent_sha256, h.fmt = "ready", e.agent_sha256, e.fmt
        h.data_bytes = e.train_bytes + e.val_bytes
        h.error = None
        self.log(e.t, e.holder, f"agent verified sha256 {e.agent_sha256[:12]}; {h.data_bytes:,} bytes ({e.fmt})")

    def _on_HolderStateChanged(self, e: ev.HolderStateChanged) -> None:
        holder, state, detail = e.holder, e.state, e.detail
        h = self.holder(holder)
        h.state = state.split("(")[0]
        if h.state == HolderState.VERIFIED and "(" in state:
            h.agent_sha256 = h.agent_sha256 or state[state.index("(") + 1:].rstrip(")")
        self.log(e.t, holder, f"{state}{': ' + detail if detail else ''}", "error" if h.state == "failed" else "info")

    def _on_ProvisionResumed(self, e: ev.ProvisionResumed) -> None:
        self.log(e.t, e.holder, f"provisioning resumed from chunk {e.resume_from} (reconnect {e.attempt})", "warn")

    def _on_RunStarted(self, e: ev.RunStarted) -> None:
        if self.status in TERMINAL_STATUSES and self._gpu is None:  # `run --resume`: the same run goes on
            self.resumed += 1
            self.error = self.error_code = None  # the interruption is history, not how this run ends
            for v in self.visits.values():
                if v.outcome == "cancelled":  # ended by the run's end (not a failure of its own): redone now
                    v.outcome = "interrupted"
        self.status = "running"
        self.run_id, self.platform, self.visits_planned = e.run_id, dict(e.platform), e.visits_planned
        self.sim = bool(e.platform.get("sim", self.sim))
        self.seed_holders(list(e.holders))
        self.log(e.t, "orchestrator", f"run {e.run_id} started: {e.visits_planned} visits over "
                 f"{len(e.holders)} holders")

    def visit(self, index: int | None) -> VisitView | None:
        """The latest attempt of visit ``index`` (0-based)."""
        row = self.rows.get(index) if index is not None else None
        return self.visits[row] if row is not None else None

    def _visit(self, visit: int, holder: str) -> VisitView:
        """The running attempt of ``visit``; an event after a failed attempt opens the next one."""
        last = self.visit(visit)
        if last is not None and last.outcome not in ("failed", "cancelled", "interrupted"):
            return last
        row = len(self.visits)
        self.visits[row] = VisitView(visit, holder, attempt=last.attempt + 1 if last is not None else 1)
        if self._gpu is not None:
            self.visits[row].gpu, self.visits[row].device = self._gpu, self.gpus[self._gpu].device_id
        self.rows[visit] = row
        if last is not None:
            self.log(self._t, "orchestrator", f"visit {visit + 1} ({holder}): attempt {last.attempt + 1}")
        return self.visits[row]

    def _on_ProvisionProgressed(self, e: ev.ProvisionProgressed) -> None:
        h = self.holder(e.holder)
        h.state, h.provisioned, h.total = HolderState.PROVISIONING, e.nbytes, e.total

    def _on_ChunkRejected(self, e: ev.ChunkRejected) -> None:
        h = self.holder(e.holder)
        h.rejected[e.code] += 1
        self.rejected_total[e.code] += 1
        self._visit(e.visit, e.holder).rejected += 1
        self.log(e.t, e.holder, f"chunk {e.seq} rejected: {e.code} ({e.reason})", "warn")

    def _on_KeyRotated(self, e: ev.KeyRotated) -> None:
        self.epoch = max(self.epoch, e.epoch)

    def _on_TrainingStepped(self, e: ev.TrainingStepped) -> None:
        first = e.step - len(e.losses) + 1
        if self._gpu is not None:  # a fleet: the GPUs train one model in lock-step; a step's loss is their mean
            for i, x in enumerate(e.losses):
                self._fleet_loss.setdefault(first + i, []).append(float(x))
            self.loss = [(step, sum(xs) / len(xs)) for step, xs in sorted(self._fleet_loss.items())]
        else:  # the steps a TrainingProgressed already showed give way to the phase's own
            self.loss = [pt for pt in self.loss if pt[0] < first] if self.loss and self.loss[-1][0] >= first else self.loss
            self.loss.extend((first + i, float(x)) for i, x in enumerate(e.losses))
        self.train_progress = None
        v = self._visit(e.visit, e.holder)
        v.loss_first = e.losses[0] if e.losses else None
        v.loss_last = e.losses[-1] if e.losses else None
        v.val_loss, v.tokens_per_s = e.val_loss, e.tokens_per_s
        if e.val_loss is not None:
            self.val.append((e.step, e.holder, float(e.val_loss)))
        self.tokens_per_s = e.tokens_per_s

    def _on_VisitCompleted(self, e: ev.VisitCompleted) -> None:
        v = self._visit(e.visit, e.holder)
        v.outcome = "done"
        if e.report.integrity_ok is not None:
            v.integrity_ok = e.report.integrity_ok
        if e.report.scrub_verified is not None:
            v.scrub_verified = e.report.scrub_verified
        h = self.holder(e.holder)
        h.visits_done += 1
        h.state = "ready"
        self.gpu_at = "orchestrator"
        self.log(e.t, "orchestrator", f"visit {e.visit + 1} ({e.holder}) done")

    def _on_VisitFailed(self, e: ev.VisitFailed) -> None:
        v = self._visit(e.visit, e.holder)
        v.outcome, v.error, v.failed_phase = "failed", e.error, e.phase
        if e.phase in v.phases:
            v.phases[e.phase].status = "failed"
        v.scrub_verified = None
        refused = HOLDER_REFUSED.search(e.error)
        if refused:  # the holder's own attestation refused the CVM or the GPU: it released no key
            v.outcome, v.error, v.failed_phase = "refused", refused.group(1), "holder"
            v.key_fp = v.integrity_ok = None  # no key was released, nothing was measured
        h = self.holder(e.holder)
        h.visits_failed += 1
        h.error = e.error
        if e.code in ("agent", "link-lost") or e.phase == "PROVISION":
            h.state = "failed"
        elif h.state in (HolderState.PROVISIONING, HolderState.RETURNED):
            h.state = "ready"
        self.gpu_at = "orchestrator"
        self.current_phase = None
        self.log(e.t, e.holder, f"visit {e.visit + 1} failed in {e.phase}: {e.error} [{e.code}]", "error")

    def _on_RunPaused(self, e: ev.RunPaused) -> None:
        self.status, self.pending = "paused", None
        self.paused_before, self.pause_reason = e.next_phase, e.reason
        why = "" if e.reason == "paused" else f" ({e.reason})"  # a breakpoint or a step says so
        self.log(e.t, "operator", f"paused{why} {f'in {e.within}' if e.within else f'before {e.next_phase}'}", "warn")

    def _on_RunResumed(self, e: ev.RunResumed) -> None:
        self.set_paused(None)
        self.log(e.t, "operator", "resumed")

    def _on_RunCompleted(self, e: ev.RunCompleted) -> None:
        self.status, self.pending = "completed", None
        self.current_phase = self.paused_before = None
        self.gpu_at = "orchestrator"
        self.log(e.t, "orchestrator", f"run completed: {e.visits} visit{'s' * (e.visits != 1)}, {e.failed} failed",
                 "info" if not e.failed else "warn")

    def _on_RunFailed(self, e: ev.RunFailed) -> None:
        self.status = "cancelled" if e.code == "cancelled" else "failed"
        self.pending = self.train_progress = None
        self.error, self.error_code = e.error, e.code
        self.current_phase = self.paused_before = None
        self.gpu_at = "orchestrator"  # the visit is aborted: no holder keeps a key into the buffer
        v = self.visit(self.current_visit)
        if v is not None:
            if v.outcome == "running":
                v.outcome = self.status
                for mark in v.phases.values():
                    if mark.status == "running":
                        mark.status = self.status
        self.log(e.t, "orchestrator", f"run {self.status}: {e.error}", "warn" if e.code == "cancelled" else "error")

    # --- summaries ----------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """The run is over (completed, failed or cancelled)."""
        return self.status in TERMINAL_STATUSES

    def visits_ended(self) -> int:
        """Visits whose latest attempt is over (a redone visit counts once)."""
        return sum(1 for row in self.rows.values() if self.visits[row].ended)

    def visits_label(self) -> str:
        """As ``gputravel runs`` writes it: visits done of those planned, and the ended ones that did not
        complete (``3/6 visits (1✗)``; a redone visit counts once, by its latest attempt)."""
        latest = [self.visits[row] for row in self.rows.values()]
        done = sum(1 for v in latest if v.outcome == "done")
        lost = sum(1 for v in latest if v.ended and v.outcome != "done")
        return f"{done}/{self.visits_planned or '?'} visits" + (f" ({lost}✗)" if lost else "")

    @property
    def next_phase(self) -> str | None:
        """The phase the engine will run next, as far as events tell."""
        if self.paused_before:
            return self.paused_before
        if self.last_phase is None:
            return str(Phase.ATTEST)
        order = [str(p) for p in VISIT_PHASES]
        if self.last_phase in order:
            i = order.index(self.last_phase)
            return order[(i + 1) % len(order)]
        return None

    def summary(self) -> dict[str, Any]:
        """A JSON-able digest (``gputravel replay --json``)."""
        return {
            "status": self.status, "run_id": self.run_id, "sim": self.sim, "device_id": self.device_id,
            "attested": self.attested, "visits_planned": self.visits_planned, "epoch": self.epoch,
            "key_fp": self.key_fp, "error": self.error, "error_code": self.error_code,
            "holders": {n: {"state": h.state, "agent_sha256": h.agent_sha256, "data_bytes": h.data_bytes,
                            "visits_done": h.visits_done, "visits_failed": h.visits_failed,
                            "rejected": dict(h.rejected)} for n, h in self.holders.items()},
            "visits": [{"visit": v.visit, "attempt": v.attempt, "holder": v.holder, "epoch": v.epoch, "key_fp": v.key_fp,
                        "outcome": v.outcome, "failed_phase": v.failed_phase, "integrity_ok": v.integrity_ok,
                        "scrub_verified": v.scrub_verified, "loss_last": v.loss_last, "val_loss": v.val_loss,
                        "phases": {p: m.status for p, m in v.phases.items()}} for v in self.visits.values()],
            "loss": [loss for _, loss in self.loss],
            "val": [{"step": s, "holder": h, "val_loss": x} for s, h, x in self.val],
            "rejected": dict(self.rejected_total),
        }


#: The fleet's fold (one per process: it keeps no state of its own, the states it folds into do).
FLEET = FleetFold()

#: What :meth:`RunState.apply` folds each event with, built once: the state's own handlers and the entries of
#: the fold objects it composes (:class:`TrainingFold`, :class:`PhaseFold`; :class:`FleetFold` takes a fleet GPU's events first).
HANDLERS: dict[type[ev.Event], Callable[[RunState, Any], None]] = {
    ev.DeviceAttested: RunState._on_DeviceAttested,
    ev.HolderConnected: RunState._on_HolderConnected,
    ev.HolderStateChanged: RunState._on_HolderStateChanged,
    ev.ProvisionResumed: RunState._on_ProvisionResumed,
    ev.RunStarted: RunState._on_RunStarted,
    ev.ProvisionProgressed: RunState._on_ProvisionProgressed,
    ev.ChunkRejected: RunState._on_ChunkRejected,
    ev.KeyRotated: RunState._on_KeyRotated,
    ev.TrainingStepped: RunState._on_TrainingStepped,
    ev.VisitCompleted: RunState._on_VisitCompleted,
    ev.VisitFailed: RunState._on_VisitFailed,
    ev.RunPaused: RunState._on_RunPaused,
    ev.RunResumed: RunState._on_RunResumed,
    ev.RunCompleted: RunState._on_RunCompleted,
    ev.RunFailed: RunState._on_RunFailed,
    **TrainingFold().handlers(),
    **PhaseFold().handlers(),
}
