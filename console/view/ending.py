"""How a run stands in words: the status its final event says, and where an operator's cancel or pause lands
(for the console's log, ``gputravel run``'s line and ``gputravel runs``)."""

from __future__ import annotations

from gputravel.core import events as ev

__all__ = ["TERMINAL_EVENTS", "control_lands", "final_status"]

#: The events after which a run is over.
TERMINAL_EVENTS = ("RunCompleted", "RunFailed")


def final_status(event: ev.Event) -> str:
    """``completed``, ``partial`` (some visits failed), ``failed`` or ``cancelled``."""
    if isinstance(event, ev.RunCompleted):
        return "partial" if event.failed else "completed"
    if isinstance(event, ev.RunFailed):
        return "cancelled" if event.code == "cancelled" else "failed"
    return "running"


def control_lands(action: str, phase: str | None) -> str:
    """Where a cancel or pause asked during ``phase`` takes effect (``core/travel/control.py``), for the
    console's log and the CLI's line."""
    if phase == "TRAIN":
        return "after the current step"
    if phase == "PROVISION":
        return "at the next chunk" if action == "cancel" else "between two provisioning keys, else after the phase"
    return "when this phase ends" if phase else "before the next phase"
