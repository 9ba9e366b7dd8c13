"""Telemetry sources: NVML, emulated device counters, replay.

Sources yield frozen snapshots (:class:`GpuSample` in a :class:`TelemetryFrame`); an unsupported field
is ``NA`` (prints ``N/A``), a machine without a driver says why in ``frame.nvml.reason``.
"""

from __future__ import annotations

from gputravel.core.telemetry.emulated import EmulatedSource
from gputravel.core.telemetry.history import METRICS, History, PhaseTracker, Point
from gputravel.core.telemetry.model import (
           NA,
           CCState,
           GpuSample,
           NAType,
           NvmlStatus,
           ProcessSample,
           TelemetryFrame,
)
from gputravel.core.telemetry.nvml import NvmlSource, explain_init_error, nvml_query
from gputravel.core.telemetry.replay import ReplaySource
from gputravel.core.telemetry.sampler import Sampler

__all__ = ["METRICS", "NA", "CCState", "EmulatedSource", "GpuSample", "History", "NAType", "NvmlSource",
           "NvmlStatus", "PhaseTracker", "Point", "ProcessSample", "ReplaySource", "Sampler", "TelemetryFrame",
           "explain_init_error", "nvml_query"]
