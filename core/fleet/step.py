"""A fleet rank's strategies for the travel engine's visit walk: ``FleetTrain`` (the step's agreement and one
weighted step of the DDP replicas), ``StepCommit`` (a checkpoint per fleet step) and ``FleetRecovery`` (the
engine's recovery with the fleet's two rules). :class:`~gputravel.core.fleet.rank.FleetRank` and :func:`~gputravel.core.fleet.rank.fleet_engine` compose them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gputravel.core import events as ev
from gputravel.core.allocator import release_free_memory
from gputravel.core.errors import FleetDeviceLostError, GpuTravelError
from gputravel.core.fleet.ddp import sample_seed
from gputravel.core.fleet.group import FleetGroup
from gputravel.core.travel.checkpoints import Checkpointer
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.recovery import Recovery
from gputravel.core.travel.training import SliceSettings, TrainStep
from gputravel.core.travel.training_log import TrainingLog
from gputravel.core.travel.visits import VisitRecord

__all__ = ["FleetRecovery", "FleetTrain", "StepCommit"]


class FleetTrain:
    """A fleet rank's ``TrainStep``: every lock-step step's agreement (each rank's weight, or that it lost its
    device) and one weighted step of the device group's DDP replicas. The rank's walk uses it for the steps
    it trains with weight 0 (idle, or its visit failed before TRAIN) too."""

    def __init__(self, *, group: FleetGroup, seed: int, device: DeviceSession, log: TrainingLog,
                 steps: int, **_unused: Any) -> None:
        self.group = group
        self.seed = seed
        self.device = device
        self.log = log
        self.steps = steps
        self.step_index = -1
        self.trained = False  # this step's all-reduce is done (its update is the fleet's)
        self.agreed: list[dict[str, Any]] | None = None
        self.allreduce_calls = 0
        self.allreduce_s = 0.0
        self.train_s = 0.0
        self.tokens = 0

    def begin(self, index: int) -> None:
        """Step ``index`` begins: nothing agreed or trained yet."""
        self.step_index, self.trained, self.agreed = index, False, None

    async def agree(self, *, weight: float, lost: bool = False) -> list[dict[str, Any]]:
        agreed: list[dict[str, Any]] = await self.group.agree({"weight": weight, "lost": lost})
        self.agreed = agreed
        return agreed

    @staticmethod
    def lost(agreed: list[dict[str, Any]]) -> list[int]:
        return [r for r, a in enumerate(agreed) if a["lost"]]

    async def train(self, rec: VisitRecord, *, fmt: str, cut: SliceSettings) -> dict[str, Any]:
        """TRAIN in a fleet: agree on the weights, then one weighted step of every replica (in one piece)."""
        plan = rec.plan
        agreed = await self.agree(weight=1.0)
        gone = self.lost(agreed)
        if gone:
            raise FleetDeviceLostError(f"GPU(s) {gone} lost: the fleet stops after this step")
        res = await self.weighted_step(weight=1.0, agreed=agreed, train=(0, plan.train_len),
                                       val=(plan.train_len, plan.val_len), fmt=fmt)
        detail = self.log.trained(rec, losses=[float(x) for x in res["losses"]], val_loss=res["val_loss"],
                                  seconds=res["seconds"], tokens_per_s=res["tokens_per_s"])
        return {**detail, "fleet_step": self.step_index, "weights": [a["weight"] for a in agreed],
                "allreduce_calls": res["allreduce_calls"]}

    async def weighted_step(self, *, weight: float, agreed: list[dict[str, Any]], train: tuple[int, int],
                            val: tuple[int, int], fmt: str) -> dict[str, Any]:
        head, _ = await asyncio.to_thread(
            self.device.client.call, "fleet_train", train_off=train[0], train_len=train[1], val_off=val[0],
            val_len=val[1], fmt=fmt, weight=weight, total_weight=sum(a["weight"] for a in agreed),
            steps=self.steps, seed=sample_seed(self.seed, self.group.rank, self.step_index))
        self.trained = True
        self.device.expected_model = head["model_digest"]
        self.allreduce_calls += int(head["allreduce_calls"])
        self.allreduce_s += float(head["allreduce_s"])
        self.train_s += float(head["seconds"])
        self.tokens += int(head["tokens"])
        return dict(head)


class StepCommit:
    """A fleet rank's ROTATE (its ``VisitCommit``): the checkpoint is named by the fleet step and written at
    once (every rank saves the same one)."""

    def __init__(self, ckpts: Checkpointer, trainer: TrainStep) -> None:
        assert isinstance(trainer, FleetTrain)
        self.ckpts = ckpts
        self.step = trainer

    async def rotated(self, rec: VisitRecord) -> dict[str, Any]:
        index = self.step.step_index
        await self.ckpts.checkpoint(index + 1, note=f"fleet step {index}")
        release_free_memory()
        rec.outcome = "done"
        return {"checkpoint_seq": index + 1}


class FleetRecovery(Recovery):
    """The engine's recovery, with two fleet rules: a dead device is lost for good (it cannot rejoin a formed
    device group), and a failure after the step's all-reduce never rolls the replica back on its own."""

    def __init__(self, *, rank: int, step: FleetTrain, **parts: Any) -> None:
        super().__init__(**parts)
        self.rank = rank
        self.step = step

    async def recover_device(self, rec: VisitRecord, exc: GpuTravelError) -> None:
        phase = str(self.walk.phase) if self.walk.phase else "?"
        rec.outcome, rec.error, rec.failed_phase = "failed", f"device died: {exc.reason}", phase
        self.audit.record(ev.VisitFailed(time.time(), rec.plan.index, rec.plan.holder, rec.epoch, phase, rec.error,
                                         "fleet-device-lost"),
                          "device-lost", phase=phase, holder=rec.plan.holder, epoch=rec.epoch,
                          outcome="fleet-device-lost", detail={"visit": rec.plan.index, "error": rec.error,
                                                               "last_checkpoint": self.ckpts.last_good})
        raise FleetDeviceLostError(f"GPU {self.rank} ({self.audit.tags.get('device')}) died in {phase}: {exc.reason}")

    async def fail_visit(self, rec: VisitRecord, exc: GpuTravelError, window_open: bool) -> None:
        if not self.step.trained:
            await super().fail_visit(rec, exc, window_open)
            return
        losses, rec.losses = rec.losses, []  # the update is the fleet's: keep this replica as it is
        try:
            await super().fail_visit(rec, exc, window_open)
        finally:
            rec.losses = losses

