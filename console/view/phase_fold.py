"""The phases of a visit in the console's view model: what ``PhaseStarted`` and ``PhaseCompleted`` change.

:class:`PhaseFold` is a fold object :class:`~gputravel.console.view.model.RunState` composes (as
:class:`~gputravel.console.view.training.TrainingFold`): a visit's phase marks, where the GPU is (with a holder
from HANDOFF to RETURN), the holder's provisioning figures, the key and the epoch, and a log line per phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gputravel.console.view.rows import HolderView, VisitView
from gputravel.core import events as ev
from gputravel.core.travel.holders import HolderState

__all__ = ["AWAY_PHASES", "PhaseFold", "PhaseState"]

#: Phases during which the GPU is, logically, with the holder (it holds a key into the buffer window).
AWAY_PHASES = frozenset({"HANDOFF", "PROVISION", "RETURN"})


class PhaseState(Protocol):
    """What the phase fold reads and writes of the run's state (:class:`~gputravel.console.view.model.RunState`
    is one), named so the fold type-checks without importing it."""

    status: str
    current_visit: int | None
    current_holder: str | None
    current_phase: str | None
    last_phase: str | None
    paused_before: str | None
    pause_reason: str | None
    gpu_at: str
    epoch: int
    key_fp: str | None
    key_visit: int | None
    phases_completed: int

    def holder(self, name: str) -> HolderView: ...

    def log(self, t: float, source: str, text: str, level: str = "info") -> None: ...

    def _visit(self, visit: int, holder: str) -> VisitView: ...


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else "?"


class PhaseFold:
    """A fold object (no base of the state): its handlers fold one event each into the state they are given."""

    def handlers(self) -> dict[type[ev.Event], Callable[[Any, Any], None]]:
        """This fold's entries of the state's event table."""
        return {ev.PhaseStarted: self.started, ev.PhaseCompleted: self.completed}

    @staticmethod
    def started(state: PhaseState, e: ev.PhaseStarted) -> None:
        v = state._visit(e.visit, e.holder)
        v.epoch = e.epoch
        v.phases[e.phase].status = "running"
        state.current_visit, state.current_holder, state.current_phase = e.visit, e.holder, e.phase
        state.paused_before = state.pause_reason = None
        if state.status in ("paused", "starting", "idle"):
            state.status = "running"
        h = state.holder(e.holder)
        if e.phase in AWAY_PHASES:
            state.gpu_at = e.holder
        if e.phase == "HANDOFF":
            h.provisioned, h.total, h.mb_s = 0, 0, None
        if e.phase == "PROVISION":
            h.state = HolderState.PROVISIONING
        if e.phase == "ATTEST":
            state.log(e.t, "orchestrator", f"visit {e.visit + 1} → {e.holder}: attest the GPU")

    @staticmethod
    def completed(state: PhaseState, e: ev.PhaseCompleted) -> None:
        v = state._visit(e.visit, e.holder)
        mark = v.phases[e.phase]
        mark.status = "ok" if e.outcome == "ok" else e.outcome
        mark.seconds, mark.nbytes = e.seconds, e.nbytes
        state.phases_completed += 1
        state.last_phase = e.phase
        if state.current_phase == e.phase:
            state.current_phase = None
        h = state.holder(e.holder)
        if e.key_fingerprint:
            v.key_fp = state.key_fp = e.key_fingerprint
            state.key_visit = e.visit
        state.epoch = max(state.epoch, e.epoch)
        if e.phase == "HANDOFF":
            state.log(e.t, e.holder, f"hand-off: epoch {e.epoch}, provisioning key {(e.key_fingerprint or '?')[:8]} "
                     f"for window {e.detail.get('window', '?')}")
        elif e.phase == "PROVISION":
            v.mb_s = e.detail.get("mb_s")
            h.mb_s, h.provisioned = v.mb_s, e.nbytes
            h.total = max(h.total, e.nbytes)
            state.log(e.t, e.holder, f"provisioned {e.nbytes / 2**20:.2f} MiB ciphertext at {v.mb_s} MB/s, "
                     f"{e.detail.get('retransmits', 0)} retransmits")
        elif e.phase == "RETURN":
            h.state = "returned"
            state.gpu_at = "orchestrator"
            state.log(e.t, e.holder, f"returned: key of epoch {e.epoch} is dead; {e.detail.get('chunks', '?')} chunks")
        elif e.phase == "VERIFY":
            v.integrity_ok = True
            state.log(e.t, "device", "integrity: code and model regions unchanged")
        elif e.phase == "TRAIN":
            state.log(e.t, "device", f"trained {e.detail.get('steps', '?')} steps: loss "
                     f"{_num(e.detail.get('loss_first'))} → {_num(e.detail.get('loss_last'))}")
        elif e.phase == "SCRUB":
            v.scrub_verified = True
            state.log(e.t, "device", f"scrub verified: {e.nbytes / 2**20:.2f} MiB read back as zero")
        elif e.phase == "ROTATE":
            state.log(e.t, "device", f"control channel rotated to epoch {e.epoch}")
