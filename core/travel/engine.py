"""The travel engine: drives the GPU from holder to holder, one visit at a time.

A visit is ATTEST -> HANDOFF -> PROVISION -> RETURN -> VERIFY -> TRAIN -> SCRUB -> ROTATE. This module
holds the run: set-up, its start (resumed from the ledger or sealed as checkpoint 0), the walk of the visits
and the one way a run ends. The run's state lives in its parts beside it: ``phase_walk`` (one visit's
phases, the device's five of them), ``device_session`` (the device, its session, epochs and expected
measurements), ``training_log`` (steps and curves), ``checkpoints`` (written in the background, restored),
``visits`` (the records and where the walk stands), ``bus`` (events, sinks and timing probes), ``control``
(pause, step, breakpoints, the fault plan), ``handoff`` (one hand-off, shared with ``bench provision``),
``audit`` (a fact's ledger row and event in one call), ``recovery`` (failed visits, dead devices and agents,
re-keying), ``training`` (the ``TrainStep`` strategy: sliced TRAIN here, the fleet's weighted step in
``core.fleet.rank``) and ``report`` (the run's typed report).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import CancelledRunError, DataError, DeviceError, GpuTravelError, StorageError
from gputravel.core.ledger import Ledger
from gputravel.core.phases import Phase
from gputravel.core.platform.base import DeviceHandle
from gputravel.core.protocol.ckptring import RingAborted
from gputravel.core.runfolder import RunFolder, sealed_settings_digest
from gputravel.core.training.store import CheckpointStore
from gputravel.core.travel.audit import ATTACK_CODES, Audit
from gputravel.core.travel.bus import EventBus
from gputravel.core.travel.checkpoints import BackgroundCommit, Checkpointer, VisitCommit
from gputravel.core.travel.control import Control, FaultPlan, Faults
from gputravel.core.travel.course import Course
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.holder_setup import attach as attach_holder_attestation
from gputravel.core.travel.holders import HolderInfo, HolderLink
from gputravel.core.travel.phase_walk import PhaseWalk
from gputravel.core.travel.probes import EngineProbe
from gputravel.core.travel.recovery import Recovery
from gputravel.core.travel.report import RunReport, build_report
from gputravel.core.travel.schedule import UNIT, VisitPlan, plan_digest, plan_visits
from gputravel.core.travel.training import SlicedTrain, SliceSettings, TrainStep
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import Itinerary, VisitRecord
from gputravel.core.travel.windows import HandoffWindows

__all__ = ["Control", "EngineProbe", "FaultPlan", "TravelEngine", "VisitRecord", "planned_start"]


class TravelEngine:
    """One run: a device session, holder links, a schedule, a ledger, checkpoints."""

    #: kept for readers of the engine: the rejection codes that count as an attack
    ATTACK_CODES = ATTACK_CODES
    #: a visit interrupted by SIGTERM or Ctrl-C is cancelled as by the operator (scrub, ``visit-cancelled``)
    scrub_when_interrupted = True

    def __init__(self, *, settings: RunSettings, device: DeviceHandle, links: list[HolderLink],
                 out_dir: Path, checkpoint_store: CheckpointStore,
                 make_program: Callable[..., dict[str, Any]], run_id: str | None = None,
                 restart_device: Callable[[], DeviceHandle] | None = None,
                 train_step: Callable[..., TrainStep] = SlicedTrain,
                 commit: Callable[[Checkpointer, TrainStep], VisitCommit] = BackgroundCommit,
                 start: Callable[[TravelEngine], Awaitable[None]] | None = None,
                 course: Callable[[TravelEngine], Course] | None = None) -> None:
        self.settings = settings
        #: how a planned run begins: resumed from the ledger, or from the initial checkpoint (``planned_start``;
        #: a fleet rank supplies its own, counted in fleet steps)
        self.start: Callable[[TravelEngine], Awaitable[None]] = start or planned_start
        self.links = {link.name: link for link in links}
        self.out_dir = Path(out_dir)
        self.make_program = make_program
        self.bus = EventBus()
        self.control = Control({Phase(b) for b in settings.breakpoints}, on_request=self.emit)
        self.device = DeviceSession(device, settings=settings, restart=restart_device)
        for link in links:
            if link.on_state is None:
                link.on_state = self.on_holder_state
        self.infos: dict[str, HolderInfo] = {}
        self.plans: list[VisitPlan] = []
        self.walk = Itinerary()
        self.ledger = Ledger.open(RunFolder(self.out_dir).ledger, run_id=run_id or uuid.uuid4().hex[:12])
        self.run_id = self.ledger.run_id
        self.audit = Audit(self.ledger, lambda event: self.emit(event))
        self.log = TrainingLog(self.audit.emit)
        #: fault injection (tests, the crash study): phase name -> action run when that phase begins, and the
        #: run's ``--fault`` plan
        self.fault: dict[str, Callable[[TravelEngine], Any]] = {}
        self.faults = Faults(FaultPlan.parse(settings.fault) if settings.fault else None,
                             kill_device=lambda: self.device.handle.kill(),
                             kill_agent=lambda holder: self.links[holder].kill())
        self.ckpts = Checkpointer(store=checkpoint_store, device=self.device, log=self.log, audit=self.audit,
                                  walk=self.walk, faults=self.faults, timing=self.bus.timing, run_id=self.run_id,
                                  every=settings.checkpoint_every,
                                  settings_sha256=sealed_settings_digest(self.out_dir))
        self.recovery = Recovery(device=self.device, ckpts=self.ckpts, log=self.log, audit=self.audit,
                                 walk=self.walk, links=self.links, infos=self.infos)
        self.windows = HandoffWindows(device=self.device, audit=self.audit, walk=self.walk, settings=settings,
                                      infos=self.infos,
                                      rekey=lambda reason: self.recovery.rekey_session(reason=reason),
                                      control=self.control, emit=self.emit)
        #: how TRAIN is cut into device requests (the default TRAIN's), and how a visit trains: the strategy
        #: ``train_step`` builds over the run's parts (a fleet rank supplies its own)
        self.train_slices = SliceSettings()
        self.trainer: TrainStep = train_step(device=self.device, log=self.log, control=self.control,
                                             emit=self.audit.emit, steps=settings.steps_per_visit)
        #: how ROTATE commits a visit (checkpoint cadence): a fleet rank supplies its own
        self.commit = commit(self.ckpts, self.trainer)
        #: one visit's phases, walked over the parts above
        self.phases = PhaseWalk(self)
        #: what the run walks instead of its visits (a fleet rank's lock-step steps), built over the parts above
        self.course: Course | None = course(self) if course is not None else None

    # --- events ------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue[ev.Event]:
        return self.bus.subscribe()

    def emit(self, event: ev.Event) -> None:
        self.bus.publish(event)

    def on_holder_state(self, holder: str, state: str, detail: str) -> None:
        """Per-host states from the holder links, as events and ledger rows."""
        event = ev.HolderStateChanged(time.time(), holder, state, detail)
        try:
            self.audit.record(event, "holder-state", holder=holder, outcome=state, detail={"detail": detail})
        except StorageError:  # a full disk: the link goes on (it may be stopping its agent); the run's own
            self.audit.emit(event)  # next row meets the same error where the run can stop on it

    # --- set-up -----------------------------------------------------------------------------------
    async def setup(self) -> None:
        result = await self.device.connect()
        claims = {c.name: c.ok for c in result.claims}
        self.audit.record(ev.DeviceAttested(time.time(), result.device_id or "?", result.ok, claims, True),
                          "attested", phase="SETUP", outcome="ok",
                          detail={"device_id": result.device_id, "claims": claims, "platform": "emulated",
                                  "session_fp": self.device.session_fp()})
        await self.device.describe()
        await asyncio.to_thread(  # holders verify the CVM and the GPU themselves
            attach_holder_attestation, out_dir=self.out_dir, run_id=self.run_id, settings=self.settings,
            links=self.links, audit=self.audit, walk=self.walk, client=lambda: self.device.client)
        # agents are deployed and started in parallel; holders keep their given order
        started = await asyncio.gather(*(self._start_link(link) for link in self.links.values()),
                                       return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        for name, info in zip(self.links, started, strict=True):
            assert isinstance(info, HolderInfo)
            self.infos[name] = info
            self.audit.record(ev.HolderConnected(time.time(), name, info.fmt, info.train_bytes, info.val_bytes,
                                                 info.agent_sha256),
                              "holder-connected", holder=name, nbytes=info.train_bytes + info.val_bytes,
                              detail={"format": info.fmt, "agent_sha256": info.agent_sha256,
                                      "transport": info.transport})
        fmts = {i.fmt for i in self.infos.values()}
        if len(fmts) > 1:
            raise DataError(f"holders disagree on the token format: {sorted(fmts)}")
        fmt = fmts.pop()
        min_train = (self.settings.seq_len + 2) * UNIT[fmt]
        self.plans = plan_visits(list(self.infos.values()), rounds=self.settings.rounds,
                                 buffer_bytes=self.settings.buffer_bytes, val_share=self.settings.val_share,
                                 min_train_bytes=min_train)
        self.walk.records = [VisitRecord(p) for p in self.plans]
        self.device.program = self.make_program(fmt=fmt, total_steps=len(self.plans) * self.settings.steps_per_visit)
        self.device.expected_code = await self.device.upload_program()
        await self.start(self)
        if self.course is not None:
            await self.course.after_setup()

    async def _start_link(self, link: HolderLink) -> HolderInfo:
        t0 = time.perf_counter()
        info = await link.start()
        self.bus.timing.on_holder_started(link.name, t0, time.perf_counter())
        return info

    # --- the run ----------------------------------------------------------------------------------
    async def run(self) -> RunReport:
        if self.course is not None:
            return await self.run_guarded(self.course.walk, planned=self.course.planned)
        return await self.run_guarded(self._walk_visits, planned=lambda: len(self.plans))

    async def _walk_visits(self) -> None:
        """Every visit not done yet, in order, each retried by the policy (``visit_attempts``); a visit undone
        because its checkpoint was lost or rolled back (``Checkpointer.rewind``) is walked again. The run
        ends once its last checkpoint is durable; a device that dies writing it is restarted and the visits
        its lost snapshot held are walked again (a loop: each pass starts from the first visit not done)."""
        while True:
            await self._walk_pass()
            try:
                await self.ckpts.finish()
                return
            except (DeviceError, RingAborted) as exc:  # the device died writing the last checkpoint
                if not await self.recovery.recover_device_between_visits(exc):
                    raise

    async def _walk_pass(self) -> None:
        given_up: set[int] = set()
        while True:
            rec = next((r for r in self.walk.records
                        if not r.outcome.startswith("done") and r.plan.index not in given_up), None)
            if rec is None:
                return
            undone = False  # an earlier visit was undone (its checkpoint died with the device): redo it first
            while True:
                rec.attempts += 1
                t_visit = time.perf_counter()
                try:
                    await self.visit(rec)
                finally:
                    self.bus.timing.on_visit(rec.plan.index, time.perf_counter() - t_visit)
                if rec.outcome != "failed" or rec.attempts >= self.settings.visit_attempts:
                    break
                self.audit.row("visit-retry", holder=rec.plan.holder, outcome="retry",
                               detail={"visit": rec.plan.index, "attempt": rec.attempts + 1,
                                       "after": f"{rec.failed_phase}: {rec.error}"})
                rec.reset_for_retry()
                undone = self._undone_before(rec, given_up)
                if undone:
                    break
            # asked once per pass of the loop above: after a retry found it (``undone``), else now
            if not rec.outcome.startswith("done") and not (undone or self._undone_before(rec, given_up)):
                given_up.add(rec.plan.index)

    def _undone_before(self, rec: VisitRecord, given_up: set[int]) -> bool:
        """Whether a visit before ``rec`` is no longer done (undone by ``Checkpointer.rewind``): visits are
        walked in order, so it goes before ``rec``'s next attempt, as in a run that never lost it."""
        return any(not r.outcome.startswith("done") and r.plan.index not in given_up
                   for r in self.walk.records if r.plan.index < rec.plan.index)

    async def run_guarded(self, body: Callable[[], Awaitable[None]], *,
                          planned: Callable[[], int]) -> RunReport:
        """Set up, run ``body`` (the walk: visits here, lock-step steps in a fleet), and end the run the one
        way every run ends: a final ledger row and event for every ending (an error, Ctrl-C, a bug), the
        holders let go first, then the device's audit, ``run-completed`` and the report. ``planned`` counts
        the visits once set-up has planned them."""
        t0 = time.perf_counter()
        ended: tuple[str, str] | None = None
        try:
            await self.setup()
            self.audit.emit(ev.RunStarted(time.time(), self.run_id, self.device.handle.info.to_dict(), tuple(self.links),
                                          planned()))
            await body()
        except GpuTravelError as exc:
            last = self.device.last_error()
            if last is not None and isinstance(exc, DeviceError):
                # the device died: its own last words say why (the link only saw a reset or a broken pipe);
                # the error keeps its class (a fleet's FleetDeviceLostError stays one: its ranks act on it)
                exc = type(exc)(f"{exc.reason}; the device service died: {last}", code=exc.code)
            ended = (str(exc), exc.code)
            raise exc from None
        except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: committed progress stays resumable
            ended = ("cancelled (interrupted)", CancelledRunError.code)
            raise
        except Exception as exc:  # a bug: still a final row, then the traceback
            ended = (f"{type(exc).__name__}: {exc}", "internal")
            raise
        finally:
            if ended is not None:  # a checkpoint in flight becomes durable (and commits its visits) if it can
                with contextlib.suppress(BaseException):
                    await self.ckpts.drop()
            await self._shutdown_links()
            if ended is not None:  # after the holders' own last rows: the run's row is the final one
                self._final_row(*ended)
        try:
            await self.phases.audit_rejections()
        except GpuTravelError:
            pass
        records = self.walk.records
        failed = sum(1 for r in records if r.outcome == "failed")
        seconds = time.perf_counter() - t0
        self.audit.record(ev.RunCompleted(time.time(), self.run_id, len(records), failed, seconds),
                          "run-completed", outcome="ok" if not failed else "partial", duration_s=seconds,
                          detail={"visits": len(records), "failed": failed})
        return self.run_report(seconds=time.perf_counter() - t0)

    def _final_row(self, error: str, code: str) -> None:
        """Every way a run ends writes a final ledger row and a final event (``run-failed`` with the error's
        code; ``run-completed`` on the way out of a finished run). A ledger that cannot take it any more
        (``LedgerError``) does not hide the run's own error."""
        last = self.device.last_error()
        detail = {"error": error, **({"device_last_error": last} if last else {})}
        try:
            self.audit.record(ev.RunFailed(time.time(), self.run_id, error, code),
                              "run-failed", outcome=code, detail=detail)
        except GpuTravelError:
            self.audit.emit(ev.RunFailed(time.time(), self.run_id, error, code))

    def run_report(self, *, seconds: float) -> RunReport:
        """The run's typed report (closes the ledger first, then verifies its chain)."""
        self.ledger.close()
        ckpts = {"dir": str(self.ckpts.store.directory), "last_seq": self.ckpts.last_good, **self.ckpts.summary()}
        out = build_report(run_id=self.run_id, out_dir=self.out_dir, chunk_kib=self.settings.chunk_kib,
                           handle=self.device.handle, device=self.device, log=self.log, walk=self.walk,
                           infos=self.infos, rejected=self.windows.rejected, checkpoints=ckpts, seconds=seconds)
        return self.course.extend_report(out) if self.course is not None else out

    async def _shutdown_links(self) -> None:
        """Let every holder go, one after another. Cancelled while doing it (a console that leaves cancels its
        run's worker as the first holder says goodbye), the holders not yet let go are still closed before the
        cancellation goes on: their agents must not outlive the run (issue 35: nothing left behind)."""
        head = self.audit.head()
        rows = self.audit.visit_rows()
        left = list(self.links.items())
        for name, link in self.links.items():
            link.farewell_head = head  # every visit's rows, for the witnesses
            link.farewell_rows = rows.get(name, {})  # its visits' rows, for its receipts
        try:
            while left:
                await close_quietly(left[0][1])
                left.pop(0)
        except asyncio.CancelledError:
            rest = asyncio.gather(*(close_quietly(link) for _, link in left))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(rest)
            raise

    async def aclose(self) -> None:
        """Shut the device service down (it scrubs nothing more: the run is over), stop its process and
        close the ledger. Safe to call after a failed or cancelled run, and more than once."""
        if self.course is not None:
            await self.course.before_close()
        await self.device.close()
        self.ledger.close()

    async def visit(self, rec: VisitRecord) -> None:
        """One visit, phase by phase (``core.travel.phase_walk``); a failed one is left to ``recovery``."""
        await self.phases.visit(rec)


async def planned_start(engine: TravelEngine) -> None:
    """The engine's start: resume from the ledger's state (``--resume``), or load the initial weights (if any),
    measure the model and seal checkpoint 0."""
    digest = plan_digest(engine.plans)
    state = engine.ledger.state_items()
    if engine.settings.resume and state.get("plan_digest"):
        if state["plan_digest"] != digest:
            raise DataError("--resume: the holders' data or the settings changed; the schedule differs")
        # never reuse an epoch number, even one whose visit was cut off before its progress was committed
        engine.device.epoch = max(int(state.get("epoch", 0)), engine.ledger.max_epoch())
        engine.ckpts.run_id = str(state.get("run_id", engine.run_id))
        done = {int(k) for k in state.get("visits_done", [])}
        for rec in engine.walk.records:
            if rec.plan.index in done:
                rec.outcome = "done (earlier run)"
        seq = state.get("checkpoint_seq")
        if seq is not None and state.get("checkpoint_digest"):
            engine.ckpts.digests[int(seq)] = str(state["checkpoint_digest"])
        if seq is not None and engine.settings.init_from is not None and engine.settings.lora_rank:
            # a LoRA checkpoint holds the adapters alone: the frozen base is the weights, uploaded again first
            path = Path(engine.settings.init_from)
            want, _ = await engine.device.load_weights(
                path, key=engine.ckpts.store.run_key(engine.ckpts.run_id), run_id=engine.ckpts.run_id)
            engine.audit.row("weights-loaded", detail={"path": str(path), "model_digest": want, "resumed": True})
        if seq is not None:
            await engine.ckpts.restore(int(seq))
        engine.log.step_count = int(state.get("steps", 0))
        engine.audit.row("resumed", detail={"visits_done": sorted(done), "epoch": engine.device.epoch,
                                            "checkpoint_seq": seq})
    else:
        if engine.settings.init_from is not None:  # pretrained weights, sealed under the run key
            path = Path(engine.settings.init_from)
            want, config = await engine.device.load_weights(
                path, key=engine.ckpts.store.run_key(engine.ckpts.run_id), run_id=engine.ckpts.run_id)
            engine.audit.row("weights-loaded", detail={"path": str(path), "model_digest": want, "model": config})
        await engine.device.measure_model()
        await engine.ckpts.checkpoint(0, note="initial")
        engine.audit.row("planned", detail={"visits": len(engine.plans), "plan_digest": digest},
                         state={"plan_digest": digest, "visits_done": [], "epoch": 0, "checkpoint_seq": 0,
                                "checkpoint_digest": engine.ckpts.digests[0], "steps": 0, "run_id": engine.run_id})


async def close_quietly(link: HolderLink) -> None:
    """``link.close()``; an error closing one holder must not hide the run's own error (nor stop the others')."""
    try:
        await link.close()
    except Exception:  # closing must not hide the run's own error
        pass
