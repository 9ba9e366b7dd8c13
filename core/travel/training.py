"""TRAIN in slices: progress, loss spikes and operator control between optimizer steps.

The device trains one bounded slice per request (``DeviceClient.train(steps=..., budget_s=...)``): the steps
still to do, cut short after ``SliceSettings.budget_s``. Between slices the engine records the losses, emits
``TrainingProgressed`` (and ``LossSpiked``) and honours cancel and pause. Slicing was chosen over progress
frames streamed from inside one request because the device protocol is one answer per request (sealed,
counted, ordered): a slice is an ordinary request, needs no new framing, and gives the engine the place
to stop. Its cost is one control round trip per slice (well under a millisecond), against a budget of
0.25 s of steps, and no extra synchronisation: the trainer already waits on each step's loss. Only the last
slice validates and hashes the model (``TrainResult.done``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from gputravel.core import events as ev
from gputravel.core.errors import DeviceError
from gputravel.core.phases import Phase
from gputravel.core.travel.control import Control, EventSink
from gputravel.core.travel.device_session import DeviceSession
from gputravel.core.travel.training_log import SpikeWatch, TrainingLog
from gputravel.core.travel.visits import VisitRecord

__all__ = ["SliceSettings", "SlicedTrain", "SpikeWatch", "TrainStep"]


@dataclass(slots=True)
class SliceSettings:
    """How TRAIN is cut: ``budget_s`` seconds of steps per request (at least one step: control lands within
    one step, or within ``budget_s`` when steps are shorter); ``max_steps`` caps a slice's steps as well
    (``1``: one request and one progress event per optimizer step)."""

    budget_s: float = 0.25
    max_steps: int | None = None


class TrainStep(Protocol):
    """A visit's TRAIN: the steps on the buffer the holder provisioned (its format ``fmt``), recorded in the
    run's log, the device's model digest the one expected after; returns the phase's detail. ``cut`` is the
    engine's slicing (a strategy that trains in one piece ignores it)."""

    async def train(self, rec: VisitRecord, *, fmt: str, cut: SliceSettings) -> dict[str, Any]: ...


class SlicedTrain:
    """One device's TRAIN: the visit's ``steps`` steps, slice by slice (progress, spikes, control between
    slices); validation and the model digest come with the last slice."""

    def __init__(self, *, device: DeviceSession, log: TrainingLog, control: Control, emit: EventSink,
                 steps: int) -> None:
        self.device = device
        self.log = log
        self.control = control
        self.emit = emit
        self.steps = steps

    async def train(self, rec: VisitRecord, *, fmt: str, cut: SliceSettings) -> dict[str, Any]:
        plan = rec.plan
        total = self.steps
        rec.losses = []
        seconds = 0.0
        done = 0
        tokens = 0
        while True:
            remaining = total - done
            want = min(remaining, cut.max_steps) if cut.max_steps else remaining
            final = want == remaining
            res = await asyncio.to_thread(self.device.client.train, train_off=0, train_len=plan.train_len,
                                          val_off=plan.train_len, val_len=plan.val_len if final else 0, fmt=fmt,
                                          steps=want, budget_s=cut.budget_s)
            if not res.losses or len(res.losses) > want:
                raise DeviceError(f"the device trained {len(res.losses)} steps of a slice of {want}")
            done += len(res.losses)
            seconds += res.seconds
            tokens += res.tokens
            self.log.record_losses(rec, res.losses)
            if done >= total:
                if not res.done or not res.model_digest:
                    raise DeviceError("the device ended TRAIN without its model digest")
                self.device.expected_model = res.model_digest
                break
            self.emit(ev.TrainingProgressed(time.time(), plan.index, plan.holder, done, total, res.losses[-1],
                                            res.tokens_per_s, self.log.step_count, tuple(res.losses)))
            await self.control.between_steps(Phase.TRAIN, self.emit, where=f"TRAIN {done}/{total}")
        return self.log.finish(rec, val_loss=res.val_loss, seconds=seconds,
                               tokens_per_s=tokens / seconds if seconds > 0 else float("inf"))
