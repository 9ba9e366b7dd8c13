"""Telemetry sources: NVML and the emulated device's counters (a replay reads frames from its recording).

Sources yield frozen snapshots (:class:`GpuSample` in a :class:`TelemetryFrame`); an unsupported field
is ``NA`` (prints ``N/A``), a machine without a driver says why in ``frame.nvml.reason``.
"""

from __future__ import annotations

from gputravel.core.telemetry.emulated import EmulatedSource
from gputravel.core.telemetry.history import (
           DATA_PHASES,
           METRICS,
           History,
           IntervalPhaseTracker,
           PhaseTracker,
           Point,
)
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
from gputravel.core.telemetry.recorded import TELEMETRY_INTERVAL_S, DeviceFeed, TelemetryLoop, rank_sampler
from gputravel.core.telemetry.sampler import Sampler

__all__ = ["DATA_PHASES", "METRICS", "NA", "TELEMETRY_INTERVAL_S", "CCState", "DeviceFeed", "EmulatedSource",
           "GpuSample", "History", "IntervalPhaseTracker", "NAType", "NvmlSource", "NvmlStatus", "PhaseTracker",
           "Point", "ProcessSample", "Sampler", "TelemetryFrame", "TelemetryLoop",
           "explain_init_error", "nvml_query", "rank_sampler"]
