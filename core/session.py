"""A console-friendly facade over the engine: one run's lifetime (build off the event loop, drive, stop)
and the device counters the telemetry samples read. (The console's view model of a run lives in
the console.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gputravel.core.phases import Phase

if TYPE_CHECKING:
    from gputravel.core.travel.engine import TravelEngine
    from gputravel.core.travel.report import RunReport

__all__ = ["Session"]


class Session:
    """One run for the console: build the engine off the event loop, drive it, stop the device.

    ``factory`` builds an engine that is not started (``core.api.build_engine``). Blocking methods are
    marked; the console calls them through ``asyncio.to_thread``.
    """

    def __init__(self, factory: Callable[[], TravelEngine]) -> None:
        self.factory = factory
        self.engine: TravelEngine | None = None
        self.report: RunReport | None = None
        self.breakpoints: set[Phase] = set()
        self._closed = False

    @property
    def built(self) -> bool:
        return self.engine is not None

    @property
    def finished(self) -> bool:
        return self._closed

    def build(self) -> TravelEngine:
        """Blocking: start the device service and wire the run."""
        engine = self.factory()
        for phase in self.breakpoints:
            engine.control.breakpoints.add(phase)
        self.breakpoints = engine.control.breakpoints
        self.engine = engine
        return engine

    @property
    def holder_names(self) -> list[str]:
        return list(self.engine.links) if self.engine is not None else []

    @property
    def out_dir(self) -> Any:
        return self.engine.out_dir if self.engine is not None else None

    async def run(self) -> RunReport:
        """Drive the run to its end; the device service is stopped however it ends."""
        assert self.engine is not None, "build() first"
        try:
            self.report = await self.engine.run()
            return self.report
        finally:
            await asyncio.to_thread(self.close)

    # --- device counters (blocking) ----------------------------------------------------------
    def device_stats(self) -> dict[str, Any]:
        if self.engine is None or self._closed or self.engine.device.client.secrets is None:
            raise RuntimeError("no attested device session yet")
        from gputravel.core.deviceclient.counters import read_counters

        return dict(read_counters(self.engine.device.handle.socket_path))

    def device_info(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        info = dict(self.engine.device.device_info)
        info.setdefault("buffer_bytes", self.engine.settings.buffer_bytes)
        return info

    # --- control ------------------------------------------------------------------------------
    def paused_at(self) -> str | None:
        if self.engine is None:
            return None
        at = self.engine.control.paused_at
        return str(at) if at is not None else None

    def toggle_breakpoint(self, phase: Phase) -> bool:
        if self.engine is not None:
            return bool(self.engine.control.toggle_breakpoint(phase))
        if phase in self.breakpoints:
            self.breakpoints.discard(phase)
            return False
        self.breakpoints.add(phase)
        return True

    def pause(self) -> None:
        if self.engine is not None:
            self.engine.control.pause()

    def resume(self) -> None:
        if self.engine is not None:
            self.engine.control.resume()

    def step(self) -> None:
        if self.engine is not None:
            self.engine.control.step()

    def cancel(self) -> None:
        if self.engine is not None:
            self.engine.control.cancel()

    def close(self) -> None:
        """Blocking: shut the device service down and close the links (idempotent)."""
        if self.engine is None or self._closed:
            return
        self._closed = True
        engine = self.engine
        try:
            if engine.device.handle.alive() and engine.device.client.secrets:
                engine.device.client.shutdown()
        except Exception:  # the device may already be gone
            pass
        engine.device.client.close()
        engine.device.handle.stop()
        try:
            engine.ledger.close()
        except Exception:
            pass
