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
from typing import TYPE_CHECKING, Any

from gputravel.core import events as ev
from gputravel.core.errors import DeviceError
from gputravel.core.travel.phases import Phase
from gputravel.core.travel.report import VisitRecord

if TYPE_CHECKING:
    from gputravel.core.travel.engine import TravelEngine

__all__ = ["SliceSettings", "SpikeWatch", "record_losses", "train_visit"]


@dataclass(slots=True)
class SliceSettings:
    """How TRAIN is cut: ``budget_s`` seconds of steps per request (at least one step: control lands within
    one step, or within ``budget_s`` when steps are shorter); ``max_steps`` caps a slice's steps as well
    (``1``: one request and one progress event per optimizer step)."""

    budget_s: float = 0.25
    max_steps: int | None = None


class SpikeWatch:
    """Flags a loss above ``factor`` times the running mean of the losses before it.

    The running mean is exponential (``alpha`` per step, about the last 20 steps) and is watched only
    after ``warmup`` steps. A spike enters the mean like any loss; the steps after it that stay above the line
    belong to the same episode and are not flagged again (a blow-up is one flag, not one per step).
    """

    __slots__ = ("alpha", "factor", "in_spike", "mean", "seen", "warmup")

    def __init__(self, *, factor: float = 1.75, alpha: float = 0.1, warmup: int = 5) -> None:
        if factor <= 1 or not 0 < alpha <= 1 or warmup < 1:
            raise ValueError("SpikeWatch needs factor > 1, 0 < alpha <= 1, warmup >= 1")
        self.factor, self.alpha, self.warmup = factor, alpha, warmup
        self.mean = 0.0
        self.seen = 0
        self.in_spike = False

    def feed(self, loss: float) -> float | None:
        """Take one step's loss; the running mean before it when it is a spike, else None."""
        before = self.mean
        above = self.seen >= self.warmup and before > 0 and loss > self.factor * before
        spiked, self.in_spike = above and not self.in_spike, above
        self.seen += 1
        self.mean = loss if self.seen == 1 else before + self.alpha * (loss - before)
        return before if spiked else None


def record_losses(e: TravelEngine, rec: VisitRecord, losses: list[float]) -> None:
    """Steps that ran: the visit's record, the run's loss history, and a ``LossSpiked`` for each spike."""
    plan = rec.plan
    for loss in losses:
        rec.losses.append(float(loss))
        e.step_count += 1
        e.loss_history.append((e.step_count, float(loss)))
        mean = e.spikes.feed(float(loss))
        if mean is not None:
            e.audit.emit(ev.LossSpiked(time.time(), plan.index, plan.holder, e.step_count, float(loss), mean,
                                       e.spikes.factor))


async def train_visit(e: TravelEngine, rec: VisitRecord) -> dict[str, Any]:
    """The visit's ``steps_per_visit`` steps, slice by slice; validation and the model digest come with the
    last slice. Returns the phase's detail (the ``TrainingStepped`` event closes it)."""
    plan = rec.plan
    fmt = e.infos[plan.holder].fmt
    total = e.settings.steps_per_visit
    cut = e.train_slices
    rec.losses = []
    seconds = 0.0
    done = 0
    tokens = 0
    while True:
        remaining = total - done
        want = min(remaining, cut.max_steps) if cut.max_steps else remaining
        final = want == remaining
        res = await asyncio.to_thread(e.client.train, train_off=0, train_len=plan.train_len,
                                      val_off=plan.train_len, val_len=plan.val_len if final else 0, fmt=fmt,
                                      steps=want, budget_s=cut.budget_s)
        if not res.losses or len(res.losses) > want:
            raise DeviceError(f"the device trained {len(res.losses)} steps of a slice of {want}")
        done += len(res.losses)
        seconds += res.seconds
        tokens += res.tokens
        record_losses(e, rec, res.losses)
        if done >= total:
            if not res.done or not res.model_digest:
                raise DeviceError("the device ended TRAIN without its model digest")
            e.expected_model = res.model_digest
            break
        e.audit.emit(ev.TrainingProgressed(time.time(), plan.index, plan.holder, done, total, res.losses[-1],
                                           res.tokens_per_s, e.step_count, tuple(res.losses)))
        await e.control.between_steps(Phase.TRAIN, e.emit, where=f"TRAIN {done}/{total}")
    return finish_training(e, rec, val_loss=res.val_loss, seconds=seconds,
                           tokens_per_s=tokens / seconds if seconds > 0 else float("inf"))


def finish_training(e: TravelEngine, rec: VisitRecord, *, val_loss: float | None, seconds: float,
                    tokens_per_s: float) -> dict[str, Any]:
    """A TRAIN whose steps are recorded (``record_losses``): validation, timing, ``TrainingStepped``, and the
    phase's detail."""
    plan = rec.plan
    rec.val_loss = val_loss
    rec.train_s = float(seconds)
    rec.tokens_per_s = float(tokens_per_s)
    if rec.val_loss is not None:
        e.val_history.append((e.step_count, plan.holder, float(rec.val_loss)))
    e.audit.emit(ev.TrainingStepped(time.time(), plan.index, plan.holder, e.step_count, tuple(rec.losses),
                                    rec.val_loss, rec.tokens_per_s))
    return {"loss_first": rec.losses[0], "loss_last": rec.losses[-1], "val_loss": rec.val_loss,
            "steps": len(rec.losses)}
