"""What the run's training did so far: the loss curve, the validation curve, the optimizer steps, the spike watch.

One ``TrainingLog`` per run. TRAIN records its steps here (``record_losses``, ``finish``); a visit that
trained and then failed, or whose checkpoint was lost, is taken back out (``rollback``), so the curves
always describe the model the device holds.
"""

from __future__ import annotations

import time
from typing import Any

from gputravel.core import events as ev
from gputravel.core.travel.control import EventSink
from gputravel.core.travel.visits import VisitRecord

__all__ = ["SpikeWatch", "TrainingLog"]


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


class TrainingLog:
    """The run's optimizer steps and curves; ``emit`` hears ``LossSpiked`` and ``TrainingStepped``."""

    def __init__(self, emit: EventSink) -> None:
        self._emit = emit
        #: (run step, loss) of every step the model holds
        self.loss_history: list[tuple[int, float]] = []
        #: (run step, holder, validation loss) after each visit that validated
        self.val_history: list[tuple[int, str, float]] = []
        self.step_count = 0
        self.spikes = SpikeWatch()

    def record_losses(self, rec: VisitRecord, losses: list[float]) -> None:
        """Steps that ran: the visit's record, the run's loss history, and a ``LossSpiked`` for each spike."""
        plan = rec.plan
        for loss in losses:
            rec.losses.append(float(loss))
            self.step_count += 1
            self.loss_history.append((self.step_count, float(loss)))
            mean = self.spikes.feed(float(loss))
            if mean is not None:
                self._emit(ev.LossSpiked(time.time(), plan.index, plan.holder, self.step_count, float(loss), mean,
                                         self.spikes.factor))

    def finish(self, rec: VisitRecord, *, val_loss: float | None, seconds: float,
               tokens_per_s: float) -> dict[str, Any]:
        """A TRAIN whose steps are recorded: validation, timing, ``TrainingStepped``, and the phase's detail."""
        plan = rec.plan
        rec.val_loss = val_loss
        rec.train_s = float(seconds)
        rec.tokens_per_s = float(tokens_per_s)
        if rec.val_loss is not None:
            self.val_history.append((self.step_count, plan.holder, float(rec.val_loss)))
        self._emit(ev.TrainingStepped(time.time(), plan.index, plan.holder, self.step_count, tuple(rec.losses),
                                      rec.val_loss, rec.tokens_per_s))
        return {"loss_first": rec.losses[0], "loss_last": rec.losses[-1], "val_loss": rec.val_loss,
                "steps": len(rec.losses)}

    def trained(self, rec: VisitRecord, *, losses: list[float], val_loss: float | None, seconds: float,
                tokens_per_s: float) -> dict[str, Any]:
        """A TRAIN that ran in one piece (a fleet's weighted step): its steps recorded, then ``finish``."""
        rec.losses = []
        self.record_losses(rec, [float(x) for x in losses])
        return self.finish(rec, val_loss=val_loss, seconds=seconds, tokens_per_s=tokens_per_s)

    def rollback(self, rec: VisitRecord) -> None:
        """A visit that trained and then failed is undone (the model is restored from the checkpoint)."""
        if rec.losses:
            del self.loss_history[len(self.loss_history) - len(rec.losses):]
            self.step_count -= len(rec.losses)
            self.val_history = [v for v in self.val_history if v[0] <= self.step_count]
