"""Composition of a run's holders: an inventory over SSH, the embedded loopback SSH server, or local
agent subprocesses; then the engine. Used by ``gputravel run`` (and the console)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gputravel.agents.fleet import EmbeddedSshServer, links_from_inventory, links_from_specs
from gputravel.console.run_telemetry import TELEMETRY_INTERVAL_S, RunTelemetry
from gputravel.core import api
from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError
from gputravel.core.events import Event
from gputravel.core.recording import Recorder
from gputravel.core.travel.holders import HolderLink


class Fleet:
    """Owns what a run's holders need (the embedded SSH server, if any) for the run's lifetime."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.server: EmbeddedSshServer | None = None

    def links(self) -> list[HolderLink] | None:
        s = self.settings
        if s.transport == "inventory":
            if s.holders_file is None:
                raise ConfigError("transport 'inventory' needs --holders-file")
            return list(links_from_inventory(s.holders_file))
        if s.transport == "ssh":
            self.server = EmbeddedSshServer(api.resolve_holder_dirs(s))
            return list(links_from_specs(self.server.start()))
        return None  # local agent subprocesses, built by core.api

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


async def run(settings: RunSettings, *, sinks: Iterable[Callable[[Event], None]] = (),
              recorder: Recorder | None = None, telemetry_interval: float = TELEMETRY_INTERVAL_S,
              on_control: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """One run with its holder fleet; with a ``recorder``, GPU telemetry is sampled into the same
    recording for as long as the run goes. ``on_control`` gets the engine's ``Control`` (pause, resume,
    step) once the engine is built (``gputravel run`` continues a breakpoint on a signal with it)."""
    import asyncio

    fleet = Fleet(settings)
    try:
        links = await asyncio.to_thread(fleet.links)
        if recorder is None:
            engine = await asyncio.to_thread(api.build_engine, settings, links=links)  # api.run, with a control
            engine.sinks.extend(sinks)
            if on_control is not None:
                on_control(engine.control)
            try:
                report = await engine.run()
            finally:
                await engine.aclose()
        else:
            report = await _run_recorded(settings, links, sinks, recorder, telemetry_interval, on_control)
        if fleet.server is not None:
            report["ssh_server"] = {"host": "127.0.0.1", "port": fleet.server.port, "embedded": True,
                                    "host_key": fleet.server.host_public.split()[0] + " (fresh, pinned)"}
        return report
    finally:
        fleet.close()


async def _run_recorded(settings: RunSettings, links: list[HolderLink] | None,
                        sinks: Iterable[Callable[[Event], None]], recorder: Recorder,
                        interval: float, on_control: Callable[[Any], None] | None = None) -> dict[str, Any]:
    import asyncio

    from gputravel.core.session import Session

    session = Session(lambda: api.build_engine(settings, links=links))
    engine = await asyncio.to_thread(session.build)
    telemetry: RunTelemetry | None = None
    try:
        engine.sinks.extend(sinks)
        if on_control is not None:
            on_control(engine.control)
        recorder.set_meta({"holders": list(engine.links), "telemetry_interval_s": interval})
        telemetry = RunTelemetry(session, recorder, interval=interval)
        engine.sinks.append(telemetry.tracker)
        telemetry.start()
        report: dict[str, Any] = await session.run()  # stops the device service however the run ends
        return report
    finally:
        if telemetry is not None:
            await telemetry.stop()
        await asyncio.to_thread(session.close)  # idempotent: for a failure before run() began
