"""GPU telemetry sampled into a run's recording while the run goes (``gputravel run``), so a replay shows
the GPU screen as the console would have. Cheap to import: the engine loads only when used.

The loop itself is :class:`gputravel.core.telemetry.TelemetryLoop` (each rank of a fleet runs one too);
this module binds it to a console :class:`~gputravel.core.session.Session` and a :class:`Recorder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gputravel.core.telemetry.history import DATA_PHASES, IntervalPhaseTracker, PhaseTracker
from gputravel.core.telemetry.recorded import TELEMETRY_INTERVAL_S, TelemetryLoop

if TYPE_CHECKING:
    from gputravel.core.recording import Recorder
    from gputravel.core.session import Session
    from gputravel.core.telemetry import Sampler

__all__ = ["DATA_PHASES", "TELEMETRY_INTERVAL_S", "RunTelemetry", "interval_tracker"]


class RunTelemetry(TelemetryLoop):
    """Samples the GPU's telemetry into a run's recording while the run goes, as the console does: NVML
    where a driver answers, and the emulated device's counters (SIM) once it is attested.

    An asyncio task in the orchestrator, not a thread (see :class:`TelemetryLoop`). :meth:`stop` ends it
    between ticks.
    """

    def __init__(self, session: Session, recorder: Recorder, *, interval: float = TELEMETRY_INTERVAL_S,
                 sampler: Sampler | None = None) -> None:
        super().__init__(session, recorder.record_telemetry, interval=interval, sampler=sampler)
        self.session = session
        self.recorder = recorder


def interval_tracker() -> PhaseTracker:
    """A phase tracker whose ``tag`` names the phase that ran during the sampling interval just ended
    (:class:`~gputravel.core.telemetry.IntervalPhaseTracker`)."""
    return IntervalPhaseTracker()
