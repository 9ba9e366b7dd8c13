"""The engine's public face for the CLI and the console: build a run, drive it, read its events.

Runs are composed in one place, :mod:`gputravel.core.compose`; this module re-exports its entry points."""

from __future__ import annotations

from gputravel.core.compose import (
    Entries,
    RunTelemetryPlan,
    build_engine,
    local_links,
    resolve_holder_dirs,
    resume_settings,
    run,
    tcp_data_host,
)
from gputravel.core.config import RunSettings
from gputravel.core.events import Event
from gputravel.core.ledger import VerifyResult, verify_ledger
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.report import RunReport

__all__ = ["Entries", "Event", "RunReport", "RunSettings", "RunTelemetryPlan", "TravelEngine", "VerifyResult", "build_engine",
           "local_links", "resolve_holder_dirs", "resume_settings", "run", "tcp_data_host", "verify_ledger"]
