"""The fleet part of the console's view model: one state per GPU, summed up into the fleet's.

:class:`FleetFolds` is a base of :class:`~gputravel.console.view.model.RunState`. In a fleet,
``apply(event, gpu=R)`` folds each GPU's (torchrun rank's) events into that GPU's own ``RunState``
(``gpus[R]``); the run events (attested, started, ended, paused) are logged once under the GPU's name and the
fleet's status, device, epoch and rate are summed up from the GPUs' (:meth:`FleetFolds._sum_up`); holder and
visit events fold into the merged state as in a single run, each tagged with its GPU. :meth:`FleetFolds.devices`
gives each GPU's card (:class:`DeviceView`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from gputravel.core import events as ev

__all__ = ["RUN_EVENTS", "TERMINAL_STATUSES", "DeviceView", "FleetFolds", "gpu_label"]


def gpu_label(gpu: int) -> str:
    """How the console names a fleet's GPU (its torchrun rank): ``GPU0``, ``GPU1``, ..."""
    return f"GPU{gpu}"


#: The statuses of a run that is over (every way a run ends; ``partial`` is ``completed`` with failed visits).
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
#: Events about a fleet rank's run as a whole: the fleet view folds them per GPU, then sums the GPUs up.
RUN_EVENTS = frozenset({"DeviceAttested", "RunStarted", "RunCompleted", "RunFailed", "RunPaused", "RunResumed"})


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One GPU of a fleet, as its own events tell it (the GPU screen's card, the travel screen's marker)."""

    gpu: int
    device_id: str | None
    status: str
    attested: bool | None
    sim: bool | None
    at: str  # "orchestrator" or the holder that holds a key into its buffer
    phase: str | None
    epoch: int
    key_fp: str | None
    visit: int | None  # the visit (0-based) it is on or made last
    holder: str | None
    visits_done: int
    visits_failed: int
    visits_planned: int
    provisioned_bytes: int  # ciphertext accepted into its buffer over the run
    last_mb_s: float | None  # the engine's timing of its last transfer
    last_transfer: str  # "visit 2, bob"
    loss_last: float | None
    tokens_per_s: float | None
    error: str | None

    @property
    def label(self) -> str:
        return gpu_label(self.gpu)


class FleetFolds:
    """The fleet's folding (``_apply_fleet``, ``_sum_up``) and its per-GPU cards (``devices``)."""

    # RunState's fields these methods read and fold into (declared here so they type-check without importing it)
    gpus: dict[int, Self]
    fleet_size: int
    _gpu: int | None
    events_seen: int
    _t: float
    status: str
    run_id: str | None
    platform: dict[str, Any]
    sim: bool | None
    attested: bool | None
    device_id: str | None
    visits: dict[int, Any]
    visits_planned: int
    current_visit: int | None
    current_phase: str | None
    gpu_at: str
    epoch: int
    key_fp: str | None
    tokens_per_s: float | None
    error: str | None
    error_code: str | None

    def apply(self, event: ev.Event, gpu: int | None = None) -> None:
        raise NotImplementedError

    def log(self, t: float, source: str, text: str, level: str = "info") -> None:
        raise NotImplementedError

    def seed_holders(self, names: list[str]) -> None:
        raise NotImplementedError

    def visit(self, index: int | None) -> Any:
        raise NotImplementedError

    def new_gpu_state(self) -> Self:
        """An empty state for one GPU's own run."""
        raise NotImplementedError

    def _apply_fleet(self: Self, event: ev.Event, gpu: int) -> None:
        if gpu not in self.gpus:
            self.gpus[gpu] = self.new_gpu_state()
            self.gpus = dict(sorted(self.gpus.items()))
        own = self.gpus[gpu]
        own.apply(event)
        self._gpu = gpu
        try:
            if event.kind in RUN_EVENTS:  # about this GPU's run: logged here, summed up below
                self.events_seen += 1
                self._t = event.t
                self._log_run_event(event, own)
            else:
                self.apply(event)
        finally:
            self._gpu = None
        self._sum_up()

    def _log_run_event(self, e: ev.Event, own: Self) -> None:
        if isinstance(e, ev.DeviceAttested):
            self.log(e.t, "device", f"attested {e.device_id}: {'ok' if e.ok else 'FAILED'}"
                     f"{' (SIM)' if e.sim else ''}", "info" if e.ok else "error")
        elif isinstance(e, ev.RunStarted):
            self.seed_holders(list(e.holders))
            self.platform = self.platform or dict(e.platform)
            self.log(e.t, "orchestrator", f"run {e.run_id} started: {e.visits_planned} visits over "
                     f"{len(e.holders)} holders")
        elif isinstance(e, ev.RunCompleted):
            ended = f"run completed: {e.visits} visit{'s' * (e.visits != 1)}, {e.failed} failed"
            self.log(e.t, "orchestrator", ended, "info" if not e.failed else "warn")
        elif isinstance(e, ev.RunFailed):
            self.log(e.t, "orchestrator", f"run {own.status}: {e.error}", "warn" if e.code == "cancelled" else "error")
            visit = self.visit(own.current_visit)
            if visit is not None and visit.outcome == "running":
                visit.outcome = own.status
                for mark in visit.phases.values():
                    if mark.status == "running":
                        mark.status = own.status
        elif isinstance(e, ev.RunPaused):
            self.log(e.t, "operator", f"paused ({e.reason}) before {e.next_phase}", "warn")

    def _sum_up(self) -> None:
        """The fleet's run from its GPUs': over when every GPU's is, failed when one failed."""
        gpus = list(self.gpus.values())
        first = gpus[0]
        self.run_id = first.run_id
        self.sim = any(g.sim for g in gpus) if any(g.sim is not None for g in gpus) else None
        self.attested = None if any(g.attested is None for g in gpus) else all(g.attested for g in gpus)
        ids = [g.device_id for g in gpus if g.device_id]
        self.device_id = ", ".join(ids) if ids else None
        self.visits_planned = sum(g.visits_planned for g in gpus)
        self.epoch = max(g.epoch for g in gpus)
        self.tokens_per_s = sum(g.tokens_per_s or 0.0 for g in gpus) or None
        away = [g.gpu_at for g in gpus if g.gpu_at != "orchestrator"]
        self.gpu_at = ", ".join(away) if away else "orchestrator"
        everyone = len(gpus) >= max(self.fleet_size, 1)
        statuses = {g.status for g in gpus}
        if everyone and statuses <= TERMINAL_STATUSES:
            self.status = ("failed" if "failed" in statuses else "cancelled" if "cancelled" in statuses
                           else "completed")
        elif statuses & {"running", "paused", "completed", "failed", "cancelled"}:
            self.status = "running"
        elif self.status == "idle":
            self.status = "starting"
        failed = next(((gpu, g) for gpu, g in self.gpus.items() if g.error), None)
        self.error = f"{gpu_label(failed[0])}: {failed[1].error}" if failed else None
        self.error_code = failed[1].error_code if failed else None

    def devices(self) -> tuple[DeviceView, ...]:
        """Each GPU of a fleet, in rank order (empty for a single GPU's run)."""
        out = []
        for gpu, own in self.gpus.items():
            visits = list(own.visits.values())
            last = next((v for v in reversed(visits) if v.mb_s), None)
            current = own.visit(own.current_visit)
            out.append(DeviceView(
                gpu=gpu, device_id=own.device_id, status=own.status, attested=own.attested, sim=own.sim,
                at=own.gpu_at, phase=own.current_phase, epoch=own.epoch, key_fp=own.key_fp,
                visit=current.visit if current is not None else None,
                holder=current.holder if current is not None else None,
                visits_done=sum(1 for v in visits if v.outcome == "done"),
                visits_failed=sum(1 for v in visits if v.outcome == "failed"),
                visits_planned=own.visits_planned,
                provisioned_bytes=sum(v.phases["PROVISION"].nbytes for v in visits),
                last_mb_s=last.mb_s if last is not None else None,
                last_transfer=f"visit {last.visit + 1}, {last.holder}" if last is not None else "",
                loss_last=next((v.loss_last for v in reversed(visits) if v.loss_last is not None), None),
                tokens_per_s=own.tokens_per_s, error=own.error))
        return tuple(out)
