"""The fleet part of the console's view model: one state per GPU, summed up into the fleet's.

:class:`FleetFold` is a fold object :class:`~gputravel.console.view.model.RunState` composes. In a fleet,
``apply(event, gpu=R)`` folds each GPU's (torchrun rank's) events into that GPU's own ``RunState``
(``gpus[R]``); the run events (attested, started, ended, paused) are logged once under the GPU's name and the
fleet's status, device, epoch and rate are summed up from the GPUs' (:meth:`FleetFold.sum_up`); holder and
visit events fold into the merged state as in a single run, each tagged with its GPU. :meth:`FleetFold.devices`
gives each GPU's card (:class:`DeviceView`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gputravel.core import events as ev

__all__ = ["RUN_EVENTS", "TERMINAL_STATUSES", "DeviceView", "FleetFold", "FleetState", "gpu_label"]


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


class FleetState(Protocol):
    """What the fleet fold reads and writes of the run's state (:class:`~gputravel.console.view.model.RunState` is
    one), named so the fold type-checks without importing it. ``gpus`` holds one such state per GPU."""

    gpus: dict[int, Any]
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

    def apply(self, event: ev.Event, gpu: int | None = None) -> None: ...

    def log(self, t: float, source: str, text: str, level: str = "info") -> None: ...

    def seed_holders(self, names: list[str]) -> None: ...

    def visit(self, index: int | None) -> Any: ...

    def new_gpu_state(self) -> Any:
        """An empty state for one GPU's own run."""


class FleetFold:
    """The fleet's fold object (no base of the state): :meth:`apply` folds one GPU's event into the state it is
    given (``RunState.apply(event, gpu=R)`` hands it here), :meth:`devices` gives the per-GPU cards."""

    def apply(self, state: FleetState, event: ev.Event, gpu: int) -> None:
        if gpu not in state.gpus:
            state.gpus[gpu] = state.new_gpu_state()
            state.gpus = dict(sorted(state.gpus.items()))
        own = state.gpus[gpu]
        own.apply(event)
        state._gpu = gpu
        try:
            if event.kind in RUN_EVENTS:  # about this GPU's run: logged here, summed up below
                state.events_seen += 1
                state._t = event.t
                self.log_run_event(state, event, own)
            else:
                state.apply(event)
        finally:
            state._gpu = None
        self.sum_up(state)

    def log_run_event(self, state: FleetState, e: ev.Event, own: FleetState) -> None:
        if isinstance(e, ev.DeviceAttested):
            state.log(e.t, "device", f"attested {e.device_id}: {'ok' if e.ok else 'FAILED'}"
                     f"{' (SIM)' if e.sim else ''}", "info" if e.ok else "error")
        elif isinstance(e, ev.RunStarted):
            state.seed_holders(list(e.holders))
            state.platform = state.platform or dict(e.platform)
            state.log(e.t, "orchestrator", f"run {e.run_id} started: {e.visits_planned} visits over "
                     f"{len(e.holders)} holders")
        elif isinstance(e, ev.RunCompleted):
            ended = f"run completed: {e.visits} visit{'s' * (e.visits != 1)}, {e.failed} failed"
            state.log(e.t, "orchestrator", ended, "info" if not e.failed else "warn")
        elif isinstance(e, ev.RunFailed):
            state.log(e.t, "orchestrator", f"run {own.status}: {e.error}", "warn" if e.code == "cancelled" else "error")
            visit = state.visit(own.current_visit)
            if visit is not None and visit.outcome == "running":
                visit.outcome = own.status
                for mark in visit.phases.values():
                    if mark.status == "running":
                        mark.status = own.status
        elif isinstance(e, ev.RunPaused):
            state.log(e.t, "operator", f"paused ({e.reason}) before {e.next_phase}", "warn")

    def sum_up(self, state: FleetState) -> None:
        """The fleet's run from its GPUs': over when every GPU's is, failed when one failed."""
        gpus = list(state.gpus.values())
        first = gpus[0]
        state.run_id = first.run_id
        state.sim = any(g.sim for g in gpus) if any(g.sim is not None for g in gpus) else None
        state.attested = None if any(g.attested is None for g in gpus) else all(g.attested for g in gpus)
        ids = [g.device_id for g in gpus if g.device_id]
        state.device_id = ", ".join(ids) if ids else None
        state.visits_planned = sum(g.visits_planned for g in gpus)
        state.epoch = max(g.epoch for g in gpus)
        state.tokens_per_s = sum(g.tokens_per_s or 0.0 for g in gpus) or None
        away = [g.gpu_at for g in gpus if g.gpu_at != "orchestrator"]
        state.gpu_at = ", ".join(away) if away else "orchestrator"
        everyone = len(gpus) >= max(state.fleet_size, 1)
        statuses = {g.status for g in gpus}
        if everyone and statuses <= TERMINAL_STATUSES:
            state.status = ("failed" if "failed" in statuses else "cancelled" if "cancelled" in statuses
                           else "completed")
        elif statuses & {"running", "paused", "completed", "failed", "cancelled"}:
            state.status = "running"
        elif state.status == "idle":
            state.status = "starting"
        failed = next(((gpu, g) for gpu, g in state.gpus.items() if g.error), None)
        state.error = f"{gpu_label(failed[0])}: {failed[1].error}" if failed else None
        state.error_code = failed[1].error_code if failed else None

    def devices(self, state: FleetState) -> tuple[DeviceView, ...]:
        """Each GPU of a fleet, in rank order (empty for a single GPU's run)."""
        out = []
        for gpu, own in state.gpus.items():
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
