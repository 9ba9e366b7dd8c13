"""A run's holders, composed for ``gputravel run`` and the console: an inventory over SSH, the embedded
loopback SSH server, or local agent subprocesses. The run itself is composed by ``gputravel.core.compose``
(through ``core.api``) with these links and the console's :data:`~gputravel.console.entries.ENTRIES`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gputravel.agents.ssh_links import EmbeddedSshServer, links_from_inventory, links_from_specs
from gputravel.console.entries import ENTRIES
from gputravel.console.run_telemetry import TELEMETRY_INTERVAL_S
from gputravel.core import api
from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError
from gputravel.core.events import Event
from gputravel.core.recording import Recorder
from gputravel.core.travel.holders import HolderLink
from gputravel.core.travel.report import RunReport

__all__ = ["HolderSet", "run"]


class HolderSet:
    """Owns what a run's holders need (the embedded SSH server, if any) for the run's lifetime."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.server: EmbeddedSshServer | None = None

    def links(self) -> list[HolderLink] | None:
        """Blocking: the holders' links; ``None`` for local agents, which the run starts itself (with
        ``ENTRIES.holder_agent``) once its folder is ready."""
        s = self.settings
        if s.transport == "inventory":
            if s.holders_file is None:
                raise ConfigError("transport 'inventory' needs --holders-file")
            return list(links_from_inventory(s.holders_file))
        if s.transport == "ssh":
            self.server = EmbeddedSshServer(api.resolve_holder_dirs(s))
            return list(links_from_specs(self.server.start()))
        return None

    def describe(self) -> dict[str, Any] | None:
        """What the run's report says of them: the embedded SSH server, if one ran."""
        if self.server is None:
            return None
        return {"host": "127.0.0.1", "port": self.server.port, "embedded": True,
                "host_key": self.server.host_public.split()[0] + " (fresh, pinned)"}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


async def run(settings: RunSettings, *, sinks: Iterable[Callable[[Event], None]] = (),
              recorder: Recorder | None = None, telemetry_interval: float = TELEMETRY_INTERVAL_S,
              on_control: Callable[[Any], None] | None = None) -> RunReport:
    """One run with its holders; with a ``recorder``, GPU telemetry is sampled into the same recording for as
    long as the run goes. ``on_control`` gets the engine's ``Control`` (pause, resume, step) once the engine
    is built (``gputravel run`` continues a breakpoint on a signal with it)."""
    import asyncio

    holders = HolderSet(settings)

    def built(engine: api.TravelEngine) -> None:
        if on_control is not None:
            on_control(engine.control)
        if recorder is not None:
            recorder.set_meta({"holders": list(engine.links), "telemetry_interval_s": telemetry_interval})

    try:
        links = await asyncio.to_thread(holders.links)
        plan = (api.RunTelemetryPlan(record=recorder.record_telemetry, interval=telemetry_interval)
                if recorder is not None else None)
        report = await api.run(settings, links=links, entries=ENTRIES, sinks=sinks, on_engine=built, telemetry=plan)
        ssh = holders.describe()
        if ssh is not None:
            report.extra["ssh_server"] = ssh
        return report
    finally:
        holders.close()
