"""A device's telemetry sampled into a sink (a run's recording) while the run goes.

:class:`TelemetryLoop` is what the composed run (``core/compose.py``) drives for ``gputravel run`` and every
rank of ``gputravel run --gpus N``: one asyncio task that, once per interval, hands one
short blocking read (NVML, and one Unix-socket round trip for the device's public counters) to the loop's
executor, passes the frame on and sleeps. Nothing runs in the device's process or on the data path.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, Protocol

from gputravel.core.telemetry.emulated import EmulatedSource
from gputravel.core.telemetry.history import IntervalPhaseTracker
from gputravel.core.telemetry.model import TelemetryFrame
from gputravel.core.telemetry.nvml import NvmlSource
from gputravel.core.telemetry.sampler import Sampler

__all__ = ["TELEMETRY_INTERVAL_S", "DeviceFeed", "TelemetryLoop", "nvml_index_of", "rank_sampler"]

#: Seconds between the telemetry samples a recorded run stores.
TELEMETRY_INTERVAL_S = 1.0


class DeviceFeed(Protocol):
    """A run's device as the emulated source follows it (:class:`gputravel.core.session.Session` is one):
    its counters and info while it is built and not finished."""

    @property
    def built(self) -> bool: ...

    @property
    def finished(self) -> bool: ...

    def device_stats(self) -> dict[str, Any]: ...

    def device_info(self) -> dict[str, Any]: ...


class TelemetryLoop:
    """Samples one run's device into ``record`` every ``interval`` seconds until :meth:`stop`.

    ``tracker`` is an engine sink: add it to the engine's sinks and each frame is tagged with the phase
    of the interval it closes. ``sampler``: NVML (all devices unless its source says otherwise) and the
    emulated device's counters, which follow ``device``.
    """

    def __init__(self, device: DeviceFeed, record: Callable[[TelemetryFrame], None], *,
                 interval: float = TELEMETRY_INTERVAL_S, sampler: Sampler | None = None) -> None:
        self.device = device
        self.record = record
        self.interval = interval
        self.sampler = sampler if sampler is not None else Sampler()
        if self.sampler.emulated is None:
            self.sampler.emulated = EmulatedSource()
        self.tracker = IntervalPhaseTracker()
        self.frames = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, name: str = "run-telemetry") -> None:
        self._task = asyncio.create_task(self._loop(), name=name)

    async def _loop(self) -> None:
        while True:
            await self.sample_once()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except TimeoutError:
                pass

    async def sample_once(self) -> TelemetryFrame:
        assert self.sampler.emulated is not None
        self.sampler.emulated.follow(self.device)
        frame = await asyncio.to_thread(self.sampler.collect, phase=self.tracker.tag)
        self.record(frame)
        self.frames += 1
        return frame

    async def stop(self, *, final: bool = False) -> None:
        """End the sampling (after the tick in flight, if any) and release NVML; ``final``: one last sample
        first, while the device still answers, so the recording ends with the run's final counters."""
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            if final:
                await self.sample_once()
        finally:
            await asyncio.to_thread(self.sampler.close)


def nvml_index_of(cuda_index: int, *, visible: str | None = None) -> int:
    """The NVML index of CUDA device ``cuda_index`` (NVML numbers every device of the machine; CUDA only
    those ``CUDA_VISIBLE_DEVICES`` lists). A list of UUIDs or MIG ids cannot be mapped without NVML: the
    CUDA index is taken as it is."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in ids) and 0 <= cuda_index < len(ids):
            return int(ids[cuda_index])
    return cuda_index


def rank_sampler(torch_device: str | None) -> Sampler:
    """A fleet rank's sampler: NVML only for its own CUDA device (``cuda:L``), none for a CPU device (NVML
    is still asked, so a frame says why it is not available), and the emulated device's counters."""
    index: tuple[int, ...] = ()
    if torch_device is not None and torch_device.startswith("cuda"):
        _, _, n = torch_device.partition(":")
        index = (nvml_index_of(int(n) if n.isdigit() else 0),)
    return Sampler(nvml=NvmlSource(indices=index), emulated=EmulatedSource())
