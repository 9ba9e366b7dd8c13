"""One torchrun rank of a fleet: a worker that drives its own device through its share of the schedule.

The worker is an orchestrator-side process (see docs/fleet.md). :func:`fleet_engine` is the travel engine
holding a :class:`FleetRank` as its course (``core/travel/course.py``), a lock-step run loop: the visit walk,
visit control, recovery, audit and report are the engine's; the fleet adds the agreement before TRAIN (every rank's weight), TRAIN as one weighted step of the device
group's DDP replicas (:mod:`gputravel.core.fleet.ddp`), a checkpoint per step on every rank, and the
replicas' digest check after every step. Its parts, each in its own module and owning its state: the
engine's strategies ``FleetTrain``, ``StepCommit`` and ``FleetRecovery`` (``core/fleet/step.py``),
:class:`FleetGroup`, the workers' own process group (gloo, torchrun's ``env://``; ``core/fleet/group.py``), which
carries nothing but that control, and :class:`FleetOptions` (``core/fleet/options.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from gputravel.core.allocator import release_free_memory
from gputravel.core.errors import (
    ConfigError,
    DataError,
    DeviceError,
    FleetDeviceLostError,
    GpuTravelError,
    ProtocolError,
    ReplicaDivergedError,
)
from gputravel.core.fleet.group import FleetGroup
from gputravel.core.fleet.options import FLEET_VARIANTS, FleetOptions
from gputravel.core.fleet.schedule import FleetPlan, FleetStep, plan_fleet
from gputravel.core.fleet.step import FleetRecovery, FleetTrain, StepCommit
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.report import RunReport
from gputravel.core.travel.schedule import VisitPlan, plan_digest

# FleetOptions and FleetGroup are imported from here too (core/fleet/options.py, group.py)
__all__ = ["FLEET_VARIANTS", "FleetGroup", "FleetOptions", "FleetRank", "fleet_engine", "fleet_start"]


def fleet_engine(*, fleet: FleetOptions, group: FleetGroup, make_program: Callable[..., dict[str, Any]],
                 **kw: Any) -> TravelEngine:
    """One rank's travel engine (``compose.run``'s ``engine_type``): its device, its holders' links, and its share
    of the lock-step schedule as the engine's course (a ``FleetRank``), with the fleet's TRAIN, commit and start."""
    engine: TravelEngine | None = None

    def program(*, fmt: str, total_steps: int) -> dict[str, Any]:
        """The training program, with the fleet's optimizer-step count (steps x steps per visit)."""
        assert engine is not None
        steps = len(plan_fleet(engine.plans, gpus=fleet.gpus).steps) * engine.settings.steps_per_visit
        return make_program(fmt=fmt, total_steps=steps)

    engine = TravelEngine(make_program=program, train_step=partial(FleetTrain, group=group, seed=kw["settings"].seed),
                          commit=StepCommit, start=fleet_start, course=partial(FleetRank, fleet=fleet, group=group),
                          **kw)
    return engine


class FleetRank:
    """One rank's course through the fleet's schedule: the device group joined, the lock-step steps, the replicas'
    digests compared, the rank's part of the report. A part its ``TravelEngine`` holds (``engine.course``)."""

    def __init__(self, engine: TravelEngine, *, fleet: FleetOptions, group: FleetGroup) -> None:
        if fleet.gpus != group.world:
            raise ConfigError(f"--gpus {fleet.gpus} but torchrun started {group.world} ranks")
        self.engine = engine
        self.fleet = fleet
        self.group = group
        assert isinstance(engine.trainer, FleetTrain)
        self.step: FleetTrain = engine.trainer
        engine.scrub_when_interrupted = False  # a rank interrupted mid all-reduce may wait on its peers: end at once
        engine.audit.tags.update(device=None, gpu=group.rank)  # every row names the device
        engine.recovery = FleetRecovery(rank=group.rank, step=self.step, device=engine.device, ckpts=engine.ckpts,
                                        log=engine.log, audit=engine.audit, walk=engine.walk, links=engine.links,
                                        infos=engine.infos)
        self.fleet_plan = FleetPlan(fleet.gpus, ())
        self.my_steps: list[tuple[FleetStep, VisitPlan | None]] = []
        self.join_info: dict[str, Any] = {}
        self.steps_log: list[dict[str, Any]] = []  # per step: weights, digests equal (from the agreements)
        self.start_step = 0

    @property
    def device_id(self) -> str | None:
        """The attested id of this rank's device (None before set-up)."""
        return self.engine.audit.tags.get("device")

    # --- set-up --------------------------------------------------------------------------------------
    async def after_setup(self) -> None:
        e = self.engine
        e.audit.tags["device"] = str(e.device.attestation.get("device_id"))
        self.fleet_plan = plan_fleet(e.plans, gpus=self.fleet.gpus)
        self.my_steps = self.fleet_plan.for_gpu(self.group.rank)
        mine = {v.index for _, v in self.my_steps if v is not None}
        e.walk.records = [r for r in e.walk.records if r.plan.index in mine]
        await self._join()

    async def _join(self) -> None:
        """The device joins the device group; the CRL it checks its neighbours against is the pinned one."""
        from cryptography.hazmat.primitives.serialization import Encoding

        device = self.engine.device
        crl = device.handle.anchors.crl
        pem = crl.public_bytes(Encoding.PEM) if crl is not None else b""
        prefix = f"gputravel/devices/{self.group.restart}"  # one device group per (torchrun job, restart)
        # every rank's device as its own worker attested it, over the authenticated worker group (never the
        # store): each device's ring neighbours must be exactly these
        mine = f"{device.attestation.get('device_id')}:{device.attestation.get('device_key_fingerprint')}"
        expected = [str(name) for name in await self.group.agree(mine)]
        head, _ = await asyncio.to_thread(
            device.client.call, "fleet_join", pem, host=self.group.store_host, port=self.group.store_port,
            prefix=prefix, rank=self.group.rank, world=self.group.world, variant=self.fleet.variant,
            backend=self.fleet.backend, timeout_s=self.fleet.timeout_s, fault=self.fleet.ring_fault,
            expected=expected)
        self.join_info = dict(head)
        self.engine.audit.row("fleet-joined", outcome="ok", detail={
            "rank": head["rank"], "world": head["world"], "backend": head["backend"], "variant": head["variant"],
            "sealed": head["sealed"], "peers": head.get("peers", {}), "send_fp": head.get("send_fp"),
            "recv_fp": head.get("recv_fp")})

    # --- the run -------------------------------------------------------------------------------------
    def planned(self) -> int:
        return len(self.engine.walk.records)

    async def walk(self) -> None:
        """This rank's lock-step steps from where the run stands (replicas compared before the first)."""
        await self._compare_replicas(-1)
        for step, plan in self.my_steps[self.start_step:]:
            await self._step(step, plan)

    async def _step(self, step: FleetStep, plan: VisitPlan | None) -> None:
        """One lock-step step on this rank: its visit (or none), the agreement, TRAIN, the digest check."""
        st, e = self.step, self.engine
        st.begin(step.index)
        lost: FleetDeviceLostError | None = None
        rec = next((r for r in e.walk.records if plan is not None and r.plan.index == plan.index), None)
        if rec is not None and not rec.outcome.startswith("done"):
            while True:
                rec.attempts += 1
                try:
                    await e.visit(rec)
                except FleetDeviceLostError as exc:
                    lost = exc
                    break
                if rec.outcome != "failed" or rec.attempts >= e.settings.visit_attempts or st.agreed:
                    break
                e.audit.row("visit-retry", holder=rec.plan.holder, outcome="retry",
                               detail={"visit": rec.plan.index, "attempt": rec.attempts + 1,
                                       "after": f"{rec.failed_phase}: {rec.error}"})
                rec.reset_for_retry()
        if st.agreed is None:  # idle, failed before TRAIN, or lost: join the step with weight 0
            agreed = await st.agree(weight=0.0, lost=lost is not None)
            if lost is None and not st.lost(agreed) and sum(a["weight"] for a in agreed) > 0:
                await self._zero_weight_train(step, agreed)
        gone = lost is not None or bool(st.lost(st.agreed or []))
        if not gone and e.ckpts.last_good != step.index + 1:  # every rank holds the replica after every step
            await e.ckpts.checkpoint(step.index + 1, note=f"fleet step {step.index}")
            release_free_memory()
        await self._compare_replicas(step.index, lost=lost)

    async def _zero_weight_train(self, step: FleetStep, agreed: list[dict[str, Any]]) -> None:
        """An idle rank (or one whose visit failed) takes part in the step's all-reduce with weight 0."""
        e = self.engine
        fmt = next(iter(e.infos.values())).fmt
        try:
            head = await self.step.weighted_step(weight=0.0, agreed=agreed, train=(0, 0), val=(0, 0), fmt=fmt)
        except (DeviceError, ProtocolError) as exc:  # the ring aborted on every rank; each replica was put back
            e.audit.row("fleet-train-failed", outcome=exc.code, detail={"fleet_step": step.index,
                                                                          "error": str(exc)})
            return
        e.log.step_count += e.settings.steps_per_visit
        e.audit.row("fleet-idle-step", outcome="ok", duration_s=float(head["seconds"]),
                       detail={"fleet_step": step.index, "weights": [a["weight"] for a in agreed],
                               "allreduce_calls": head["allreduce_calls"], "model_digest": head["model_digest"]})

    async def _compare_replicas(self, index: int, *, lost: FleetDeviceLostError | None = None) -> None:
        """After a step (``-1``: before the first) every rank's replica digest; a lost device stops all."""
        e = self.engine
        if lost is None and e.device.handle.alive():
            await e.device.measure_model()
        agreed = self.step.agreed
        mine = {"digest": e.device.expected_model, "lost": lost is not None,
                "weight": agreed[self.group.rank].get("weight") if agreed else None}
        everyone = await self.group.agree(mine)
        gone = [r for r, a in enumerate(everyone) if a["lost"]]
        digests = [a["digest"] for a in everyone if not a["lost"]]
        equal = len(set(digests)) == 1
        entry = {"step": index, "weights": [a["weight"] for a in everyone], "digests_equal": equal,
                 "digest": digests[0] if equal and digests else None, "lost": gone}
        if index >= 0:
            self.steps_log.append(entry)
            done = index + 1
            state: dict[str, Any] | None = None
            if gone:
                pass  # nothing moves: every rank's last checkpoint is the last completed step
            elif equal:
                state = {"fleet_steps_done": done, "checkpoint_seq": done, "epoch": e.device.epoch,
                         "steps": e.log.step_count,
                         "visits_done": [r.plan.index for r in e.walk.records if r.outcome.startswith("done")]}
            else:  # diverged: the step is not the fleet's; a resume redoes it from the step before
                state = {"fleet_steps_done": index, "checkpoint_seq": index}
            e.audit.row("fleet-step", outcome="ok" if equal and not gone else "lost" if gone else "diverged",
                           detail={**entry, "holders": list(self.fleet_plan.steps[index].holders)}, state=state)
        elif not equal:
            raise ReplicaDivergedError("the fleet's replicas differ before the first step (programs or checkpoints "
                                       "differ)")
        if gone:
            raise FleetDeviceLostError(f"GPU(s) {gone} lost for good in fleet step {index}; every rank's last "
                                       f"checkpoint is step {e.ckpts.last_good}: resume with --resume")
        if not equal:
            by_rank = ", ".join(f"GPU {r}: {str(a['digest'])[:16]}" for r, a in enumerate(everyone))
            raise ReplicaDivergedError(f"the fleet's replicas diverged in step {index} ({by_rank}); the step is "
                                       f"not committed: --resume continues from step {index}")

    async def before_close(self) -> None:
        device = self.engine.device
        try:
            if device.handle.alive() and device.client.secrets:
                await asyncio.to_thread(device.client.call, "fleet_leave")
        except (GpuTravelError, OSError):
            pass

    # --- report --------------------------------------------------------------------------------------
    def extend_report(self, out: RunReport) -> RunReport:
        """This rank's report (the engine's), each visit naming its device, the rank's own in ``extra``;
        rank 0 merges them."""
        step_of = {v.index: s.index for s in self.fleet_plan.steps for v in s.slots if v is not None}
        for visit in out.visits:
            visit.update(device=self.device_id, gpu=self.group.rank, step=step_of.get(visit["visit"]))
        st = self.step
        out.extra["gpu"] = {"rank": self.group.rank, "device_id": self.device_id, "join": self.join_info,
                            "epochs": self.engine.device.epoch, "ledger_head": out.ledger.head,
                            "ledger_rows": out.ledger.rows,
                            "allreduce_calls": st.allreduce_calls, "allreduce_s": round(st.allreduce_s, 6),
                            "train_s": round(st.train_s, 6), "tokens": st.tokens}
        out.extra["fleet_steps"] = self.steps_log
        out.extra["fleet_plan"] = self.fleet_plan.to_dict()
        return out


async def fleet_start(engine: TravelEngine) -> None:
    """A fleet rank's start (``TravelEngine``'s ``start`` strategy): as ``planned_start``, counted in fleet steps:
    checkpoint ``s`` is the replica after ``s`` steps, and a resumed fleet continues from the step every rank
    completed."""
    rank = engine.course
    assert isinstance(rank, FleetRank)
    fleet_digest = plan_fleet(engine.plans, gpus=rank.fleet.gpus).digest()
    digest = plan_digest(engine.plans)
    state = engine.ledger.state_items()
    resume = engine.settings.resume and state.get("fleet_digest")
    if resume and state["fleet_digest"] != fleet_digest:
        raise DataError("--resume: the holders' data, the settings or --gpus changed; the schedule differs")
    done = int(state.get("fleet_steps_done", 0)) if resume else 0
    everyone = await rank.group.agree(done)
    rank.start_step = min(everyone)
    if resume:
        engine.device.epoch = max(int(state.get("epoch", 0)), engine.ledger.max_epoch())  # epochs are never reused
        engine.ckpts.run_id = str(state.get("run_id", engine.run_id))
        await engine.ckpts.restore(rank.start_step)
        engine.log.step_count = rank.start_step * engine.settings.steps_per_visit
        engine.audit.row("resumed", detail={"fleet_steps_done": rank.start_step, "epoch": engine.device.epoch,
                                            "checkpoint_seq": rank.start_step, "ranks_done": everyone})
    else:
        await engine.device.measure_model()
        await engine.ckpts.checkpoint(0, note="initial")
        engine.audit.row("planned", detail={"visits": len(engine.plans), "plan_digest": digest,
                                            "fleet_digest": fleet_digest, "gpus": rank.fleet.gpus,
                                            "my_visits": [r.plan.index for r in engine.walk.records]},
                         state={"plan_digest": digest, "fleet_digest": fleet_digest, "visits_done": [],
                                "epoch": 0, "checkpoint_seq": 0, "fleet_steps_done": 0, "steps": 0,
                                "run_id": engine.run_id})
