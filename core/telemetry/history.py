"""History ring buffers, each sample tagged with the protocol phase that was running.

A PCIe spike then reads as "bob · PROVISION" rather than as a bare number.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from gputravel.core import events as ev
from gputravel.core.telemetry.model import GpuSample, TelemetryFrame

__all__ = ["DATA_PHASES", "METRICS", "History", "IntervalPhaseTracker", "PhaseTracker", "Point"]

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
        self._last: dict[str, tuple[float, str | None]] = {}  # device key -> (t, phase) of its last sample

    def push(self, frame: TelemetryFrame) -> None:
        for device in frame.devices:
            self.push_sample(device, t=frame.t, phase=frame.phase)

    def push_sample(self, sample: GpuSample, *, t: float, phase: str | None) -> None:
        self._last[sample.key] = (t, phase)
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

    def last(self, device: str) -> tuple[float, str | None] | None:
        """When the device's last sample was taken and the phase it was in (kept even where every metric
        of that sample read ``NA``); None before its first."""
        return self._last.get(device)

    def clear(self) -> None:
        self._series.clear()
        self._last.clear()


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


#: Phases that move data over the bus, most telling first: a sample whose interval saw one is tagged with it.
DATA_PHASES = ("PROVISION", "RETURN", "HANDOFF")


class IntervalPhaseTracker(PhaseTracker):
    """A phase tracker whose ``tag`` names the phase that ran during the sampling interval just ended, not
    only the one running when the sample is taken: PCIe counters are averages over that interval, so a
    transfer that ended a moment before the sample belongs to PROVISION, not to the TRAIN that follows."""

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
