"""One visit's phase walk: ATTEST -> HANDOFF -> PROVISION -> RETURN -> VERIFY -> TRAIN -> SCRUB -> ROTATE.

Each phase is entered the one way (the legal transition checked, the operator's gate and breakpoints, the
``PhaseStarted`` event, the fault points and the ``--fault`` plan), runs its step and is timed and audited
(``PhaseCompleted`` and its ledger row). The holder's three phases are ``HandoffWindows``' (``windows``); the
device's five are here: fresh evidence and the measurement (ATTEST), code and model untouched (VERIFY), the
run's ``TrainStep`` (TRAIN), the zeroed buffer (SCRUB), the new epoch and the visit's commit (ROTATE). A visit
that fails goes to the engine's ``Recovery``; one cancelled or interrupted is scrubbed first.

A part the ``TravelEngine`` holds (``engine.phases``), built over the engine as a ``Course`` is: it reads the
engine's parts when it uses them, so a part a course replaces (a fleet rank's recovery) or a test sets
(``train_slices``, ``fault``) is the one it uses. It knows the engine only as ``RunParts``, the parts it reads
(nothing in core/travel imports ``engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gputravel.core import events as ev
from gputravel.core.errors import (
    AgentError,
    CancelledRunError,
    DataError,
    DeviceError,
    GpuTravelError,
    IntegrityError,
    ProtocolError,
)
from gputravel.core.phases import Phase, check_transition
from gputravel.core.travel.audit import Audit
from gputravel.core.travel.bus import EventBus
from gputravel.core.travel.checkpoints import Checkpointer, VisitCommit
from gputravel.core.travel.control import Control, Faults
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.holders import HolderInfo, HolderLink
from gputravel.core.travel.recovery import Recovery
from gputravel.core.travel.training import SliceSettings, TrainStep
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import Itinerary, VisitRecord
from gputravel.core.travel.windows import HandoffWindows, Outcome, Visit

__all__ = ["PhaseWalk", "RunParts"]


class RunParts(Protocol):
    """What the phase walk reads of its run (a ``TravelEngine``), each when it uses it."""

    device: DeviceSession
    windows: HandoffWindows
    links: dict[str, HolderLink]
    infos: dict[str, HolderInfo]
    audit: Audit
    walk: Itinerary
    log: TrainingLog
    ckpts: Checkpointer
    recovery: Recovery
    control: Control
    faults: Faults
    bus: EventBus
    trainer: TrainStep
    commit: VisitCommit
    train_slices: SliceSettings
    #: fault injection: phase name -> action run on the run as that phase begins
    fault: dict[str, Callable[[Any], Any]]
    #: a visit interrupted by SIGTERM or Ctrl-C is scrubbed (False: a fleet rank ends at once)
    scrub_when_interrupted: bool

    def emit(self, event: ev.Event) -> None: ...


class PhaseWalk:
    """The phases of one visit, in order, over the engine's parts (module docstring)."""

    def __init__(self, engine: RunParts) -> None:
        self.engine = engine
        windows = engine.windows
        #: the phase walk of one visit: each step returns its outcome (bytes, detail)
        self.steps: tuple[tuple[Phase, Callable[[Visit], Awaitable[Outcome]]], ...] = (
            (Phase.ATTEST, self._attest), (Phase.HANDOFF, windows.handoff),
            (Phase.PROVISION, windows.provision), (Phase.RETURN, windows.return_),
            (Phase.VERIFY, self._verify), (Phase.TRAIN, self._train),
            (Phase.SCRUB, self._scrub), (Phase.ROTATE, self._rotate))

    async def visit(self, rec: VisitRecord) -> None:
        e = self.engine
        plan = rec.plan
        e.walk.current = rec
        rec.epoch = e.device.epoch + 1
        rec.key_fingerprint = None
        e.walk.phase = None
        v = e.windows.start(rec, e.links[plan.holder])
        try:
            for phase, step in self.steps:
                t = await self._enter(rec, phase)
                nbytes, detail = await step(v)
                self._done(rec, phase, t, nbytes=nbytes, detail=detail)
            if not e.ckpts.owns(rec):  # committed here (a fleet step's checkpoint), else when it is durable
                # no checkpoint_seq here: a fleet's checkpoints are named by its step and become the run's only
                # once the step is agreed (its fleet-step row says so); a peer lost before that leaves the last
                # agreed one, which --resume must find in the state (session 15); no digest of another checkpoint
                e.audit.row("visit-completed", holder=plan.holder, epoch=rec.epoch, key_fp=rec.key_fingerprint,
                            nbytes=rec.bytes, duration_s=sum(rec.phase_s.values()), outcome="ok",
                            detail={"visit": plan.index, "part": plan.part_id},
                            state={"visits_done": [r.plan.index for r in e.walk.records
                                                   if r.outcome.startswith("done")],
                                   "epoch": e.device.epoch, "checkpoint_digest": None, "steps": e.log.step_count})
            e.walk.phase = Phase.DONE
            e.audit.emit(ev.VisitCompleted(time.time(), plan.index, plan.holder, rec.epoch, rec.summary()))
        except CancelledRunError as exc:
            v.abandon()
            await e.recovery.cancel_visit(rec, exc, v.window_open)
            raise
        except asyncio.CancelledError:  # SIGTERM (runs stop) or Ctrl-C: within a training slice, and scrubbed
            v.abandon()
            if e.scrub_when_interrupted:
                with contextlib.suppress(GpuTravelError, OSError):
                    await e.recovery.cancel_visit(rec, CancelledRunError("interrupted (SIGTERM or Ctrl-C)"),
                                                  v.window_open)
            raise
        except (AgentError, ProtocolError, IntegrityError, DataError, DeviceError) as exc:
            v.abandon()
            if not e.device.handle.alive():
                await e.recovery.recover_device(rec, exc)
                return
            await e.recovery.fail_visit(rec, exc, v.window_open)

    async def audit_rejections(self) -> None:
        """The device's rejections since the last audit, attributed to their visits."""
        e = self.engine
        await e.device.new_rejections(lambda by_epoch: e.audit.rejections(by_epoch, e.walk.records))

    # --- the device's phases ------------------------------------------------------------------------
    async def _attest(self, v: Visit) -> Outcome:
        """Fresh evidence, and the code and model are what we left there (the holder checks its own evidence for
        this hand-off meanwhile, unless it did as the visit before trained: ``HandoffWindows.prefetch_for``)."""
        e = self.engine
        e.windows.prefetch_for(v.rec, e.links)
        await self.audit_rejections()
        result = await asyncio.to_thread(e.device.client.attest)
        await e.device.check_measurement("before hand-off")
        return 0, {"device_id": result.device_id, "ok": result.ok}

    async def _verify(self, v: Visit) -> Outcome:
        """Nobody touched code or model while the holder held a key."""
        device = self.engine.device
        checked = await device.check_measurement("after return", mac_only=True)
        v.rec.integrity_ok = True
        return 0, {"model": device.expected_model, **checked}

    async def _train(self, v: Visit) -> Outcome:
        """k steps on the buffer, as the run's ``TrainStep`` trains (sliced on one device: progress, spikes and
        control between slices, validation on the held-out slice; ``core.travel.training``)."""
        e = self.engine
        fmt = e.infos[v.rec.plan.holder].fmt
        e.windows.prefetch(v.rec, e.links)  # the next holder attests meanwhile
        return 0, await e.trainer.train(v.rec, fmt=fmt, cut=e.train_slices)

    async def _scrub(self, v: Visit) -> Outcome:
        """Zero the buffer and check it before anyone else gets a key."""
        scrub = await asyncio.to_thread(self.engine.device.client.scrub)
        v.rec.scrub_verified = bool(scrub.verified)
        if not v.rec.scrub_verified:
            raise DeviceError("the buffer did not read back as zero after the scrub")
        return scrub.bytes, {}

    async def _rotate(self, v: Visit) -> Outcome:
        """New control-channel epoch; the visit is done and committed as the run's ``VisitCommit`` says
        (``core.travel.checkpoints``: in the background every ``checkpoint_every``-th visit on one device)."""
        e = self.engine
        rec = v.rec
        await asyncio.to_thread(e.device.client.rotate)
        detail = await e.commit.rotated(rec)
        e.audit.emit(ev.KeyRotated(time.time(), rec.epoch, rec.key_fingerprint or ""))
        return 0, detail

    # --- between phases -----------------------------------------------------------------------------
    async def _enter(self, rec: VisitRecord, phase: Phase) -> float:
        e = self.engine
        walk = e.walk
        if walk.phase is not None and walk.phase not in (Phase.DONE,):
            check_transition(walk.phase, phase)
        await e.control.gate(phase, e.emit)
        walk.phase = e.control.phase = phase
        e.audit.emit(ev.PhaseStarted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch))
        self._fault_point(phase)
        plan = e.faults.take(phase, rec.plan.index, rec.attempts)
        killed = e.faults.arm(plan, rec.plan.holder) if plan is not None else None
        if killed is not None:  # an agent killed as the phase begins is dead before the phase goes on
            await killed
        return time.perf_counter()

    def _done(self, rec: VisitRecord, phase: Phase, t0: float, *, nbytes: int = 0, outcome: str = "ok",
              detail: dict[str, Any] | None = None) -> None:
        e = self.engine
        dt = time.perf_counter() - t0
        rec.phase_s[str(phase)] = dt
        fp = rec.key_fingerprint if phase in (Phase.HANDOFF, Phase.PROVISION, Phase.RETURN) else None
        e.audit.record(ev.PhaseCompleted(time.time(), rec.plan.index, rec.plan.holder, str(phase), rec.epoch, dt,
                                         outcome, nbytes, fp, detail or {}),
                       "phase", phase=str(phase), holder=rec.plan.holder, epoch=rec.epoch, key_fp=fp, nbytes=nbytes,
                       duration_s=dt, outcome=outcome, detail={"visit": rec.plan.index, **(detail or {})})
        e.bus.timing.on_phase(rec.plan.index, phase, dt)

    def _fault_point(self, phase: Phase) -> None:
        """Fault injection hook (tests and the crash study): the engine's ``fault`` action for ``phase``, if
        any, run on the engine as that phase begins."""
        action = self.engine.fault.pop(str(phase), None)
        if action is not None:
            action(self.engine)
