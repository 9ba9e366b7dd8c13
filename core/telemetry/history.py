"""History ring buffers, each sample tagged with the protocol phase that was running.

A PCIe spike then reads as "bob · PROVISION" rather than as a bare number.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from gputravel.core import events as ev
from gputravel.core.telemetry.model import GpuSample, TelemetryFrame

__all__ = ["METRICS", "History", "PhaseTracker", "Point"]

#: Metrics kept per device: name -> GpuSample attribute.
METRICS: dict[str, str] = {"util": "util_gpu", "mem": "mem_used", "pcie_tx": "pcie_tx_bps",
                           "pcie_rx": "pcie_rx_bps", "power": "power_w", "temp": "temp_c"}


@dataclass(frozen=True, slots=True)
class Point:
    t: float
    value: float
    phase: str | None


class History:
    """``capacity`` most recent points per (device key, metric); ``NA`` samples are skipped."""

    def __init__(self, capacity: int = 240) -> None:
        self.capacity = capacity
        self._series: dict[tuple[str, str], deque[Point]] = {}

    def push(self, frame: TelemetryFrame) -> None:
        for device in frame.devices:
            self.push_sample(device, t=frame.t, phase=frame.phase)

    def push_sample(self, sample: GpuSample, *, t: float, phase: str | None) -> None:
        for metric, attr in METRICS.items():
            value = getattr(sample, attr)
            if isinstance(value, int | float) and not isinstance(value, bool):
                key = (sample.key, metric)
                if key not in self._series:
                    self._series[key] = deque(maxlen=self.capacity)
                self._series[key].append(Point(t, float(value), phase))

    def points(self, device: str, metric: str) -> list[Point]:
        return list(self._series.get((device, metric), ()))

    def values(self, device: str, metric: str) -> list[float]:
        return [p.value for p in self._series.get((device, metric), ())]

    def peak(self, device: str, metric: str) -> Point | None:
        """The highest point kept, with the phase it happened in (the first one, on ties)."""
        series = self._series.get((device, metric))
        if not series:
            return None
        return max(series, key=lambda p: p.value)

    def clear(self) -> None:
        self._series.clear()


class PhaseTracker:
    """An engine event sink that knows which phase runs now; its ``tag`` labels telemetry samples."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.phase: str | None = None

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.PhaseStarted):
            self.holder, self.phase = event.holder, event.phase
        elif isinstance(event, ev.PhaseCompleted) and event.phase == self.phase:
            self.phase = None
        elif isinstance(event, ev.VisitFailed | ev.RunCompleted | ev.RunFailed):
            self.holder = self.phase = None

    @property
    def tag(self) -> str | None:
        if self.phase is None:
            return None
        return f"{self.holder} · {self.phase}" if self.holder else self.phase

    def to_dict(self) -> dict[str, Any]:
        return {"holder": self.holder, "phase": self.phase}
