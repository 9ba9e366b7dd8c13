"""Picks the telemetry sources and merges them into one frame per tick.

NVML when a driver answers; the emulated device's counters (SIM) whenever a device service is
attached; a frame that only says why when neither is there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gputravel.core.telemetry.emulated import EmulatedSource
from gputravel.core.telemetry.model import TelemetryFrame
from gputravel.core.telemetry.nvml import NvmlSource

__all__ = ["Sampler"]


class Sampler:
    """Blocking (NVML and the device link block): call :meth:`collect` from a worker thread."""

    def __init__(self, *, nvml: NvmlSource | None = None, emulated: EmulatedSource | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml if nvml is not None else NvmlSource()
        self.emulated = emulated
        self._clock = clock

    def collect(self, *, phase: str | None = None) -> TelemetryFrame:
        status = self.nvml.open()
        devices = list(self.nvml.sample()) if status.available else []
        if self.emulated is not None and self.emulated.stats is not None:
            devices.append(self.emulated.sample())
        source = "nvml" if status.available else ("emulated" if devices else "none")
        return TelemetryFrame(t=self._clock(), source=source, nvml=status, devices=tuple(devices), phase=phase)

    def close(self) -> None:
        self.nvml.close()
