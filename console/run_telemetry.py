"""GPU telemetry for a run's recording and the console's screens: the sampling interval and the phase tracker.
Cheap to import: the engine loads only when used.

The sampling loop itself is :class:`gputravel.core.telemetry.TelemetryLoop`, which the composed run
(``gputravel.core.compose.run``, given a ``RunTelemetryPlan``) drives for ``gputravel run`` and every rank of
a fleet.
"""

from __future__ import annotations

from gputravel.core.telemetry.history import DATA_PHASES, IntervalPhaseTracker, PhaseTracker
from gputravel.core.telemetry.recorded import TELEMETRY_INTERVAL_S

__all__ = ["DATA_PHASES", "TELEMETRY_INTERVAL_S", "interval_tracker"]


def interval_tracker() -> PhaseTracker:
    """A phase tracker whose ``tag`` names the phase that ran during the sampling interval just ended
    (:class:`~gputravel.core.telemetry.IntervalPhaseTracker`)."""
    return IntervalPhaseTracker()
