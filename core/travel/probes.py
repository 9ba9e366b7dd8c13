"""The engine's public timing hook: benchmarks attach an ``EngineProbe`` instead of patching internals.

The engine calls every probe in ``engine.bus.probes`` at fixed points (``perf_counter`` seconds): a holder
link started (deploy), a phase completed, a sealed checkpoint written, a visit attempt ended. A probe
never changes the run; ``Timings`` keeps them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gputravel.core.phases import Phase

__all__ = ["EngineProbe", "Timings"]


class EngineProbe:
    """Override what you need; every hook does nothing by default."""

    def on_holder_started(self, holder: str, started: float, ready: float) -> None:
        """``holder``'s link ran ``start()`` (connect, deploy, agent HELLO) from ``started`` to ``ready``."""

    def on_phase(self, visit: int, phase: Phase, seconds: float) -> None:
        """A phase of ``visit`` completed after ``seconds`` (what the visit record's ``phase_s`` holds)."""

    def on_checkpoint(self, seq: int, seconds: float) -> None:
        """Sealed checkpoint ``seq`` (device state fetched, sealed, written) took ``seconds``."""

    def on_visit(self, visit: int, seconds: float) -> None:
        """One attempt at ``visit`` took ``seconds`` of wall time, bookkeeping between phases included."""


@dataclass
class Timings(EngineProbe):
    """Every timing the engine reports, by holder, visit and checkpoint."""

    holder_started: dict[str, tuple[float, float]] = field(default_factory=dict)
    phase_s: dict[int, dict[str, float]] = field(default_factory=dict)
    checkpoint_s: dict[int, float] = field(default_factory=dict)
    visit_wall_s: dict[int, float] = field(default_factory=dict)

    def on_holder_started(self, holder: str, started: float, ready: float) -> None:
        self.holder_started.setdefault(holder, (started, ready))

    def on_phase(self, visit: int, phase: Phase, seconds: float) -> None:
        self.phase_s.setdefault(visit, {})[str(phase)] = seconds

    def on_checkpoint(self, seq: int, seconds: float) -> None:
        self.checkpoint_s[seq] = seconds

    def on_visit(self, visit: int, seconds: float) -> None:
        self.visit_wall_s[visit] = seconds

    def deploy_wall_s(self) -> float | None:
        """From the first holder's start to the last holder's HELLO (all start in parallel)."""
        if not self.holder_started:
            return None
        spans = self.holder_started.values()
        return max(e for _, e in spans) - min(s for s, _ in spans)
