"""Operator control between phases (pause, resume, step, breakpoints, cancel) and the fault plan."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from gputravel.core import events as ev
from gputravel.core.errors import CancelledRunError, ConfigError
from gputravel.core.travel.phases import Phase

__all__ = ["Control", "EventSink", "FaultPlan"]

EventSink = Callable[[ev.Event], None]


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """``kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+SECONDS]``: kill that process when the
    visit's phase begins, or SECONDS into it. Fault injection for the crash study and its tests."""

    target: str
    phase: Phase
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
            return cls(target, Phase(phase.upper()), int(visit), float(delay or 0))
        except ValueError as exc:
            raise ConfigError(f"fault plan {text!r} is not kill-orchestrator|kill-device|kill-agent@PHASE:VISIT[+S]: "
                              f"{exc}") from None

    def matches(self, phase: Phase, visit: int, attempt: int) -> bool:
        return phase == self.phase and visit == self.visit and attempt == 1


class Control:
    """Pause / resume / step / breakpoints / cancel, checked between phases."""

    def __init__(self, breakpoints: set[Phase] | None = None) -> None:
        self.breakpoints: set[Phase] = set(breakpoints or ())
        self._running = asyncio.Event()
        self._running.set()
        self._steps = 0  # phases allowed while paused
        self.cancelled = False
        self.paused_at: Phase | None = None
        self._stepped = False

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        self._steps = 0
        self._running.clear()

    def resume(self) -> None:
        self._steps = 0
        self._running.set()

    def step(self) -> None:
        """Run exactly one more phase, then pause again."""
        self._steps += 1
        self._running.set()

    def cancel(self) -> None:
        self.cancelled = True
        self._running.set()

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
            await self._running.wait()
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
