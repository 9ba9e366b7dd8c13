"""A run's course: what a ``TravelEngine`` walks instead of its visits, when a caller gives one (a fleet rank).

The engine owns set-up, the visit's phase walk (``phase_walk``), recovery and the report; a ``Course`` is a part it holds
(``TravelEngine(course=...)``, built with the engine once its parts exist) that says what comes after set-up,
what the run's body is, what comes before the device is closed and what the report adds. A single run has
none: it walks its visits (``TravelEngine._walk_visits``). The fleet's is ``core.fleet.rank.FleetRank``.
"""

from __future__ import annotations

from typing import Protocol

from gputravel.core.travel.report import RunReport

__all__ = ["Course"]


class Course(Protocol):
    """The engine's hooks for a run that is not a walk of its own visits."""

    async def after_setup(self) -> None:
        """Once the engine is set up (device attested, holders started, visits planned, the run started)."""

    async def walk(self) -> None:
        """The run's body (the engine's ``run_guarded`` wraps it)."""

    def planned(self) -> int:
        """How many visits this run walks (once set up)."""
        ...

    async def before_close(self) -> None:
        """Before the engine closes its device."""

    def extend_report(self, out: RunReport) -> RunReport:
        """The engine's report, with this course's part."""
        ...
