"""Operator control (pause, resume, step, breakpoints, cancel) and the fault plan.

Cancel and pause are checked between phases (:meth:`Control.gate`) and, inside TRAIN, between training slices
(:meth:`Control.between_steps`): a slice is one optimizer step, or the steps that fit in its time budget when
steps are shorter. Inside PROVISION a cancel is checked at every acknowledged chunk
(:meth:`Control.check_cancelled`, from the engine's progress callback), and a pause between the window's keys
(``between_steps``: a paused provisioning never holds a holder's key open), else at the phase's end.
Asking is a ``ControlRequested`` event at once (the pending CANCELLING... / PAUSING... state); landing is
``RunPaused`` or the cancelled visit's end."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gputravel.core import events as ev
from gputravel.core.errors import CancelledRunError, ConfigError
from gputravel.core.phases import Phase

__all__ = ["Control", "EventSink", "FaultPlan", "Faults"]

EventSink = Callable[[ev.Event], None]


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """``kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+SECONDS]``: kill that process when the
    visit's phase begins, or SECONDS into it. Fault injection for the crash study and its tests.

    ``PHASE`` may also be ``CHECKPOINT``: the moment the visit's checkpoint (sealed at ROTATE; visit ``-1`` is
    the initial one) has its first sealed chunk in the temporary file, i.e. a kill in the middle of the write."""

    target: str
    phase: Phase | str
    visit: int
    delay: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        try:
            what, where = text.split("@", 1)
            phase, rest = where.split(":", 1)
            visit, _, delay = rest.partition("+")
            target = what.removeprefix("kill-")
            if target not in ("orchestrator", "device", "agent") or not what.startswith("kill-"):
                raise ValueError(what)
            point: Phase | str = "CHECKPOINT" if phase.upper() == "CHECKPOINT" else Phase(phase.upper())
            return cls(target, point, int(visit), float(delay or 0))
        except ValueError as exc:
            raise ConfigError(f"fault plan {text!r} is not kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+S]: "
                              f"{exc}") from None

    def matches(self, phase: Phase | str, visit: int, attempt: int) -> bool:
        return str(phase) == str(self.phase) and visit == self.visit and attempt == 1


class Faults:
    """The run's one ``FaultPlan`` (fault injection: the crash study and its tests), fired at most once."""

    def __init__(self, plan: FaultPlan | None, *, kill_device: Callable[[], None],
                 kill_agent: Callable[[str], Awaitable[None]]) -> None:
        self.plan = plan
        self._kill_device = kill_device
        self._kill_agent = kill_agent

    def take(self, phase: Phase | str, visit: int, attempt: int) -> FaultPlan | None:
        """The plan if it is for this point (it is then spent: once per run), else None."""
        plan = self.plan
        if plan is None or not plan.matches(phase, visit, attempt):
            return None
        self.plan = None
        return plan

    def arm(self, plan: FaultPlan, holder: str | None) -> asyncio.Future[None] | None:
        """Kill the plan's process now or ``plan.delay`` s from now; an agent killed now is returned as the
        future of its death."""
        if plan.delay <= 0:
            return self.fire(plan, holder)
        asyncio.get_running_loop().call_later(plan.delay, self.fire, plan, holder)
        return None

    def fire(self, plan: FaultPlan, holder: str | None) -> asyncio.Future[None] | None:
        if plan.target == "orchestrator":
            os.kill(os.getpid(), signal.SIGKILL)
        elif plan.target == "device":
            self._kill_device()
        elif plan.target == "agent" and holder is not None:
            return asyncio.ensure_future(self._kill_agent(holder))
        return None


class Control:
    """Pause / resume / step / breakpoints / cancel, checked between phases (and TRAIN's slices)."""

    def __init__(self, breakpoints: set[Phase] | None = None, *, on_request: EventSink | None = None) -> None:
        self.breakpoints: set[Phase] = set(breakpoints or ())
        #: where ``ControlRequested`` goes (the engine's emit), and the phase it names (the engine sets it)
        self.on_request = on_request
        self.phase: Phase | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._steps = 0  # phases allowed while paused
        self.cancelled = False
        self.paused_at: Phase | None = None
        self._stepped = False
        #: ``perf_counter_ns`` spent paused so far: what a visit's timings leave out (its window's Tx: a hand-off
        #: stepped or paused before PROVISION is not a slow transfer)
        self.paused_ns = 0

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        if not self.paused or self._stepped:  # not yet paused (a stepped phase runs unpaused): now pending
            self._request("pause")
        self._steps = 0
        self._stepped = False  # an explicit pause: it lands mid-phase too, even in a stepped phase
        self._running.clear()

    def resume(self) -> None:
        self._steps = 0
        self._running.set()

    def step(self) -> None:
        """Run exactly one more phase, then pause again."""
        self._steps += 1
        self._running.set()

    def cancel(self) -> None:
        if not self.cancelled:
            self._request("cancel")
        self.cancelled = True
        self._running.set()

    def check_cancelled(self) -> None:
        """Raise ``CancelledRunError`` when a cancel is pending: a synchronous check for callbacks inside a
        phase (each acknowledged provisioning chunk), where awaiting a pause is not possible."""
        if self.cancelled:
            raise CancelledRunError("cancelled by the operator")

    def _request(self, action: str) -> None:
        if self.on_request is not None:
            self.on_request(ev.ControlRequested(time.time(), action, str(self.phase) if self.phase else None))

    async def between_steps(self, phase: Phase, emit: EventSink, *, where: str) -> None:
        """Inside a phase, between optimizer steps: honour cancel and an explicit pause (``RunPaused`` with
        ``next_phase`` ``phase``, reason ``paused``, ``where`` e.g. ``"TRAIN 3/8"`` in the log); breakpoints and
        step stay between phases (a stepped phase runs to its end)."""
        if self.cancelled:
            raise CancelledRunError("cancelled by the operator")
        if not self.paused or self._stepped:
            return
        self.paused_at = phase
        emit(ev.RunPaused(time.time(), "paused", str(phase), where))
        await self._wait()
        self.paused_at = None
        emit(ev.RunResumed(time.time()))
        if self.cancelled:
            raise CancelledRunError("cancelled by the operator")
        if self._steps:  # stepped from a mid-phase pause: the rest of this phase is the step
            self._steps -= 1
            if self._steps == 0:
                self._running.clear()
                self._stepped = True

    async def _wait(self) -> None:
        t0 = time.perf_counter_ns()
        try:
            await self._running.wait()
        finally:
            self.paused_ns += time.perf_counter_ns() - t0

    def toggle_breakpoint(self, phase: Phase) -> bool:
        if phase in self.breakpoints:
            self.breakpoints.discard(phase)
            return False
        self.breakpoints.add(phase)
        return True

    async def gate(self, phase: Phase, emit: EventSink) -> None:
        """Between phases: honour cancel, breakpoints, pause and step. Every pause is a ``RunPaused``
        event (reason: breakpoint, step or paused) and every resume a ``RunResumed``."""
        if self.cancelled:
            raise CancelledRunError("cancelled by the operator")
        reason = "paused" if self.paused else None
        if phase in self.breakpoints and self._steps == 0 and not self.paused:
            self._running.clear()
            reason = "breakpoint"
        elif reason and self._stepped:
            reason = "step"
        if self.paused:
            self.paused_at = phase
            emit(ev.RunPaused(time.time(), reason or "paused", str(phase)))
            await self._wait()
            self.paused_at = None
            emit(ev.RunResumed(time.time()))
            if self.cancelled:
                raise CancelledRunError("cancelled by the operator")
        self._stepped = False
        if self._steps:
            self._steps -= 1
            if self._steps == 0:
                self._running.clear()  # the phase that now runs is the last one of this step
                self._stepped = True
