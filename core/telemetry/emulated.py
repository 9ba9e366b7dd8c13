"""The emulated GPU's telemetry: the device service's real counters, labelled SIM.

Utilisation is the share of wall time the device service spent inside operations; "PCIe RX" is the
rate of ciphertext bytes it accepted into the data buffer (the host-to-device path of the emulation).
Power, temperature and clocks have no emulated counterpart and read ``NA``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gputravel.core.telemetry.model import NA, CCState, GpuSample

__all__ = ["EmulatedSource"]

StatsFn = Callable[[], dict[str, Any]]


class EmulatedSource:
    """Samples ``stats()`` (the device's ``stats`` operation) and turns counter deltas into rates."""

    name = "emulated"

    def __init__(self, stats: StatsFn | None = None, *, info: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self.info: dict[str, Any] = dict(info or {})
        self._clock = clock
        self._last: tuple[float, float, int] | None = None  # (t, busy_s, bytes_in)

    def attach(self, stats: StatsFn | None, *, info: dict[str, Any] | None = None) -> None:
        """Point the source at a (new) device service, or at none."""
        self.stats = stats
        if info is not None:
            self.info = dict(info)
        self._last = None

    def follow(self, session: Any) -> None:
        """Track a run's device (a :class:`gputravel.core.session.Session`): its counters and info while it is
        built and not finished, none after."""
        if session.built and not session.finished:
            if self.stats is None:
                self.attach(session.device_stats)
            self.info = session.device_info()
        elif self.stats is not None:
            self.attach(None)

    def sample(self) -> GpuSample:
        name = str(self.info.get("device_name") or "emulated confidential GPU")
        cc = CCState(feature="on" if self.info.get("cc_mode") == "on" else self.info.get("cc_mode", NA),
                     environment="sim")
        if self.stats is None:
            return GpuSample(index=0, name=name, sim=True, cc=cc, note="no device service running")
        try:
            stats = self.stats()
        except Exception as exc:  # telemetry degrades, never crashes
            self._last = None
            return GpuSample(index=0, name=name, sim=True, cc=cc, note=f"device service not answering: {exc}")
        now = self._clock()
        busy = float(stats.get("busy_s", 0.0))
        bytes_in = int(stats.get("counters", {}).get("bytes_in", 0))
        util: Any = NA
        rx: Any = NA
        if self._last is not None:
            t0, busy0, in0 = self._last
            dt = now - t0
            if dt > 0:
                util = round(max(0.0, min(100.0, (busy - busy0) / dt * 100.0)), 1)
                rx = max(0.0, (bytes_in - in0) / dt)
        self._last = (now, busy, bytes_in)
        buffer_bytes = self.info.get("buffer_bytes")
        return GpuSample(
            index=0,
            name=name,
            uuid=str(self.info["device_id"]) if self.info.get("device_id") else NA,  # NA until attested
            sim=True,
            util_gpu=util,
            mem_used=int(stats.get("memory_bytes", 0)),
            mem_total=NA,
            pcie_rx_bps=rx,
            rx_bytes=bytes_in,
            cc=cc if not buffer_bytes else CCState(feature=cc.feature, environment="sim",
                                                    protected_mem_kib=int(buffer_bytes) // 1024),
            note=f"emulated on {self.info.get('device', '?')}; epoch {stats.get('epoch', '?')}",
        )
