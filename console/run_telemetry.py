"""GPU telemetry sampled into a run's recording while the run goes (``gputravel run``), so a replay shows
the GPU screen as the console would have. Cheap to import: the engine and NVML load only when used."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputravel.core.recording import Recorder
    from gputravel.core.session import Session
    from gputravel.core.telemetry import PhaseTracker, Sampler

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
        from gputravel.core.telemetry import EmulatedSource, Sampler

        self.session = session
        self.recorder = recorder
        self.interval = interval
        self.sampler = sampler if sampler is not None else Sampler()
        if self.sampler.emulated is None:
            self.sampler.emulated = EmulatedSource()
        self.tracker = interval_tracker()  # an engine sink: tags each frame with the phase of its interval
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


#: Phases that move data over the bus, most telling first: a sample whose interval saw one is tagged with it.
DATA_PHASES = ("PROVISION", "RETURN", "HANDOFF")


def interval_tracker() -> PhaseTracker:
    """A phase tracker whose ``tag`` names the phase that ran during the sampling interval just ended, not
    only the one running when the sample is taken: PCIe counters are averages over that interval, so a
    transfer that ended a moment before the sample belongs to PROVISION, not to the TRAIN that follows."""
    from gputravel.core import events as ev
    from gputravel.core.telemetry import PhaseTracker

    class IntervalPhaseTracker(PhaseTracker):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str | None, str]] = []  # (holder, phase) started since the last tag

        def __call__(self, event: ev.Event) -> None:
            if isinstance(event, ev.PhaseStarted):
                self.seen.append((event.holder, event.phase))
            super().__call__(event)

        @property
        def tag(self) -> str | None:
            seen, self.seen = self.seen, []
            if self.phase is not None:
                seen.append((self.holder, self.phase))
            for wanted in DATA_PHASES:
                for holder, phase in seen:
                    if phase == wanted:
                        return f"{holder} · {phase}" if holder else phase
            if not seen:
                return None
            holder, phase = seen[-1]
            return f"{holder} · {phase}" if holder else phase

    return IntervalPhaseTracker()
