"""GPU telemetry sampled into a run's recording while the run goes (``gputravel run``), so a replay shows
the GPU screen as the console would have. Cheap to import: the engine and NVML load only when used."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputravel.core.recording import Recorder
    from gputravel.core.session import Session
    from gputravel.core.telemetry import Sampler

#: Seconds between the telemetry samples a recorded run stores.
TELEMETRY_INTERVAL_S = 1.0


class RunTelemetry:
    """Samples the GPU's telemetry into a run's recording while the run goes, as the console does: NVML
    where a driver answers, and the emulated device's counters (SIM) once it is attested.

    An asyncio task in the orchestrator, not a thread: each tick is one short blocking read (NVML, and one
    Unix-socket round trip for the device's public counters) handed to the loop's executor, then the task
    sleeps. Nothing runs in the device's process or on the data path. :meth:`stop` ends it between ticks.
    """

    def __init__(self, session: Session, recorder: Recorder, *, interval: float = TELEMETRY_INTERVAL_S,
                 sampler: Sampler | None = None) -> None:
        from gputravel.core.telemetry import EmulatedSource, PhaseTracker, Sampler

        self.session = session
        self.recorder = recorder
        self.interval = interval
        self.sampler = sampler if sampler is not None else Sampler()
        if self.sampler.emulated is None:
            self.sampler.emulated = EmulatedSource()
        self.tracker = PhaseTracker()  # an engine sink: tags each frame with the phase that runs
        self.frames = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="run-telemetry")

    async def _loop(self) -> None:
        while True:
            await self.sample_once()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except TimeoutError:
                pass

    async def sample_once(self) -> None:
        assert self.sampler.emulated is not None
        self.sampler.emulated.follow(self.session)
        frame = await asyncio.to_thread(self.sampler.collect, phase=self.tracker.tag)
        self.recorder.record_telemetry(frame)
        self.frames += 1

    async def stop(self) -> None:
        """End the sampling (after the tick in flight, if any) and release NVML."""
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await asyncio.to_thread(self.sampler.close)
