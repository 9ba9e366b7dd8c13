"""The training part of the console's view model: steps as they come, loss spikes, the pending control.

:class:`TrainingFolds` is a base of :class:`~gputravel.console.view.model.RunState`: it folds
``TrainingProgressed``, ``LossSpiked``, ``ControlRequested`` and ``VisitCancelled`` into that state's fields
(``loss``, ``train_progress``, ``spikes``, ``pending``) and log. Visits are shown 1-based (``visit 1`` is the
run's first); events, ledger rows and JSON keep the 0-based index ``visit``.
"""

from __future__ import annotations

from typing import Any

from gputravel.console.view.ending import control_lands
from gputravel.core import events as ev

__all__ = ["TrainingFolds", "pending_label"]


def pending_label(pending: str | None) -> str | None:
    """What the status shows while a control is asked and has not landed."""
    return {"cancel": "cancelling...", "pause": "pausing..."}.get(pending or "")


class TrainingFolds:
    """Event handlers (``_on_<Event>``) that :meth:`RunState.apply` dispatches to (``model.HANDLERS``)."""

    # RunState's fields these handlers fold into (declared here so the handlers type-check without importing it)
    _gpu: int | None
    loss: list[tuple[int, float]]
    tokens_per_s: float | None
    train_progress: tuple[int, int] | None
    pending: str | None
    spikes: list[tuple[int, float, float]]

    def log(self, t: float, source: str, text: str, level: str = "info") -> None:
        raise NotImplementedError

    def _visit(self, visit: int, holder: str) -> Any:
        raise NotImplementedError

    def _on_TrainingProgressed(self, e: ev.TrainingProgressed) -> None:
        if self._gpu is None:
            self.loss.extend((e.run_step - len(e.losses) + 1 + i, float(x)) for i, x in enumerate(e.losses))
        self.train_progress, self.tokens_per_s = (e.step, e.steps), e.tokens_per_s

    def _on_LossSpiked(self, e: ev.LossSpiked) -> None:
        self.spikes.append((e.run_step, e.loss, e.mean))
        self.log(e.t, "device", f"loss spike at step {e.run_step}: {e.loss:.3f} > {e.factor:g} x running mean "
                 f"{e.mean:.3f}", "warn")

    def _on_ControlRequested(self, e: ev.ControlRequested) -> None:
        self.pending = e.action
        self.log(e.t, "operator", f"{e.action} asked{f' during {e.phase}' if e.phase else ''}: lands "
                 f"{control_lands(e.action, e.phase)}", "warn")

    def _on_VisitCancelled(self, e: ev.VisitCancelled) -> None:
        v = self._visit(e.visit, e.holder)
        v.outcome, v.failed_phase, v.scrub_verified = "cancelled", e.phase, e.scrub_verified
        for mark in v.phases.values():
            mark.status = "cancelled" if mark.status == "running" else mark.status
        self.pending, self.train_progress = None, None
        steps = f" after {e.steps} step{'s' * (e.steps != 1)}" if e.phase == "TRAIN" else ""
        self.log(e.t, e.holder, f"visit {e.visit + 1} cancelled in {e.phase or '-'}{steps}; scrub "
                 f"{'verified' if e.scrub_verified else 'NOT verified'}", "warn")

