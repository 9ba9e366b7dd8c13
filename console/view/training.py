"""The training part of the console's view model: steps as they come, loss spikes, the pending control.

:class:`TrainingFold` is a fold object :class:`~gputravel.console.view.model.RunState` composes: it folds
``TrainingProgressed``, ``LossSpiked``, ``ControlRequested`` and ``VisitCancelled`` into that state's fields
(``loss``, ``train_progress``, ``spikes``, ``pending``) and log. Visits are shown 1-based (``visit 1`` is the
run's first); events, ledger rows and JSON keep the 0-based index ``visit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gputravel.console.view.ending import control_lands
from gputravel.core import events as ev

__all__ = ["TrainingFold", "TrainingState", "pending_label"]


def pending_label(pending: str | None) -> str | None:
    """What the status shows while a control is asked and has not landed."""
    return {"cancel": "cancelling...", "pause": "pausing..."}.get(pending or "")


class TrainingState(Protocol):
    """What the training fold reads and writes of the run's state (:class:`~gputravel.console.view.model.RunState`
    is one), named so the fold type-checks without importing it."""

    loss: list[tuple[int, float]]
    tokens_per_s: float | None
    train_progress: tuple[int, int] | None
    pending: str | None
    spikes: list[tuple[int, float, float]]

    @property
    def folding_gpu(self) -> int | None: ...

    def log(self, t: float, source: str, text: str, level: str = "info") -> None: ...

    def _visit(self, visit: int, holder: str) -> Any: ...


class TrainingFold:
    """A fold object (no base of the state): its handlers fold one event each into the state they are given, and
    :meth:`handlers` lists them by event type for the one table :meth:`RunState.apply` dispatches through."""

    def handlers(self) -> dict[type[ev.Event], Callable[[Any, Any], None]]:
        """This fold's entries of the state's event table."""
        return {ev.TrainingProgressed: self.progressed, ev.LossSpiked: self.spiked,
                ev.ControlRequested: self.control_requested, ev.VisitCancelled: self.visit_cancelled}

    @staticmethod
    def progressed(state: TrainingState, e: ev.TrainingProgressed) -> None:
        if state.folding_gpu is None:
            state.loss.extend((e.run_step - len(e.losses) + 1 + i, float(x)) for i, x in enumerate(e.losses))
        state.train_progress, state.tokens_per_s = (e.step, e.steps), e.tokens_per_s

    @staticmethod
    def spiked(state: TrainingState, e: ev.LossSpiked) -> None:
        state.spikes.append((e.run_step, e.loss, e.mean))
        state.log(e.t, "device", f"loss spike at step {e.run_step}: {e.loss:.3f} > {e.factor:g} x running mean "
                  f"{e.mean:.3f}", "warn")

    @staticmethod
    def control_requested(state: TrainingState, e: ev.ControlRequested) -> None:
        state.pending = e.action
        state.log(e.t, "operator", f"{e.action} asked{f' during {e.phase}' if e.phase else ''}: lands "
                  f"{control_lands(e.action, e.phase)}", "warn")

    @staticmethod
    def visit_cancelled(state: TrainingState, e: ev.VisitCancelled) -> None:
        v = state._visit(e.visit, e.holder)
        v.outcome, v.failed_phase, v.scrub_verified = "cancelled", e.phase, e.scrub_verified
        for mark in v.phases.values():
            mark.status = "cancelled" if mark.status == "running" else mark.status
        state.pending, state.train_progress = None, None
        steps = f" after {e.steps} step{'s' * (e.steps != 1)}" if e.phase == "TRAIN" else ""
        state.log(e.t, e.holder, f"visit {e.visit + 1} cancelled in {e.phase or '-'}{steps}; scrub "
                  f"{'verified' if e.scrub_verified else 'NOT verified'}", "warn")
