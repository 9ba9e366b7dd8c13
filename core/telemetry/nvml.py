"""The NVML source: nvidia-ml-py behind one query wrapper that turns "unsupported" into ``NA``.

Every NVML call goes through :func:`nvml_query`; a field the driver does not offer (or a function the
bindings lack) reads ``NA`` and the rest of the sample still arrives. ``nvmlInit`` failing is not an
error either: :meth:`NvmlSource.open` returns an :class:`NvmlStatus` that says why (for instance
"NVML library not found"), and the sample is empty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pynvml

from gputravel.core.telemetry.model import NA, CCState, GpuSample, NAType, NvmlStatus, ProcessSample

__all__ = ["NvmlSource", "nvml_query", "explain_init_error"]

T = TypeVar("T")

#: Values pynvml defines; read from the module in use when it has them (a fake module may not).
_CONSTANTS = {"NVML_TEMPERATURE_GPU": 0, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2,
              "NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 1}
_CC_ENVIRONMENT = {0: "unavailable", 1: "sim", 2: "prod"}


def nvml_query(fn: Callable[..., T] | None, *args: Any, default: Any = NA) -> T | Any:
    """Call one NVML function; an unsupported field, a missing function or a lost GPU gives ``default``."""
    if fn is None:
        return default
    try:
        value = fn(*args)
    except pynvml.NVMLError:
        return default
    if isinstance(value, bytes):  # older bindings return C strings
        return value.decode(errors="replace")
    return value


def explain_init_error(exc: BaseException) -> str:
    """Why NVML is unavailable, in the words an operator needs."""
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this machine"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "NVIDIA driver not loaded"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "no permission to query NVML"
    if isinstance(exc, pynvml.NVMLError_LibRmVersionMismatch):
        return "NVML library and kernel driver versions differ (reboot or reload the driver)"
    return f"NVML initialisation failed: {exc}"


def _process_name(pid: int) -> str | NAType:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or NA
    except OSError:
        return NA


def _scaled(value: Any, factor: float) -> Any:
    return NA if value is NA or value is None else value * factor


class NvmlSource:
    """Reads every device NVML sees, or only those of ``indices`` (a fleet rank: its own device; ``()``:
    none, while the status still says whether NVML answers). ``nvml`` is the bindings module (pynvml
    unless a test passes one)."""

    name = "nvml"

    def __init__(self, *, nvml: ModuleType | Any | None = None, indices: Iterable[int] | None = None) -> None:
        self._nvml: Any = nvml if nvml is not None else pynvml
        self.indices = None if indices is None else tuple(indices)
        self._lock = threading.Lock()
        self._open = False
        self._failed = False
        self.status = NvmlStatus(available=False, reason="not probed yet")

    def _fn(self, name: str) -> Callable[..., Any] | None:
        return getattr(self._nvml, name, None)

    def _const(self, name: str) -> Any:
        return getattr(self._nvml, name, _CONSTANTS[name])

    def open(self) -> NvmlStatus:
        """Initialise NVML once (a failure is remembered, not retried every tick); never raises."""
        with self._lock:
            if self._open or self._failed:
                return self.status
            try:
                self._nvml.nvmlInit()
            except pynvml.NVMLError as exc:
                self._failed = True
                self.status = NvmlStatus(available=False, reason=explain_init_error(exc))
                return self.status
            except OSError as exc:  # a broken libnvidia-ml.so
                self._failed = True
                self.status = NvmlStatus(available=False, reason=f"NVML library could not be loaded: {exc}")
                return self.status
            self._open = True
            count = nvml_query(self._fn("nvmlDeviceGetCount"), default=0)
            self.status = NvmlStatus(
                available=True,
                reason=None if count else "NVML answered but sees no devices",
                driver_version=nvml_query(self._fn("nvmlSystemGetDriverVersion")),
                nvml_version=nvml_query(self._fn("nvmlSystemGetNVMLVersion")),
                cuda_driver_version=nvml_query(self._fn("nvmlSystemGetCudaDriverVersion")),
                device_count=int(count),
            )
            return self.status

    def close(self) -> None:
        with self._lock:
            if self._open:
                nvml_query(self._fn("nvmlShutdown"))
                self._open = False

    # --- sampling ---------------------------------------------------------------------------
    def sample(self) -> tuple[GpuSample, ...]:
        """One snapshot per device (empty when NVML is unavailable)."""
        if not self.open().available:
            return ()
        wanted = [i for i in range(self.status.device_count) if self.indices is None or i in self.indices]
        if not wanted:
            return ()
        cc_system = self._cc_system()
        return tuple(self._device(i, cc_system) for i in wanted)

    def _cc_system(self) -> dict[str, Any]:
        state = nvml_query(self._fn("nvmlSystemGetConfComputeState"))
        out: dict[str, Any] = {}
        if state is not NA:
            out["feature"] = "on" if getattr(state, "ccFeature", 0) else "off"
            out["devtools"] = "on" if getattr(state, "devToolsMode", 0) else "off"
            out["environment"] = _CC_ENVIRONMENT.get(getattr(state, "environment", -1), NA)
        ready = nvml_query(self._fn("nvmlSystemGetConfComputeGpusReadyState"))
        out["gpus_ready"] = NA if ready is NA else bool(ready)
        return out

    def _device(self, index: int, cc_system: dict[str, Any]) -> GpuSample:
        q, fn = nvml_query, self._fn
        handle = q(fn("nvmlDeviceGetHandleByIndex"), index)
        if handle is NA:
            return GpuSample(index=index, name="N/A", note="NVML could not open this device (lost or busy)")
        util = q(fn("nvmlDeviceGetUtilizationRates"), handle)
        mem = q(fn("nvmlDeviceGetMemoryInfo"), handle)
        cc_mem = q(fn("nvmlDeviceGetConfComputeMemSizeInfo"), handle)
        procs = q(fn("nvmlDeviceGetComputeRunningProcesses"), handle, default=())
        return GpuSample(
            index=index,
            name=str(q(fn("nvmlDeviceGetName"), handle)),
            uuid=q(fn("nvmlDeviceGetUUID"), handle),
            util_gpu=NA if util is NA else util.gpu,
            util_mem=NA if util is NA else util.memory,
            mem_used=NA if mem is NA else mem.used,
            mem_total=NA if mem is NA else mem.total,
            power_w=_scaled(q(fn("nvmlDeviceGetPowerUsage"), handle), 1e-3),
            power_limit_w=_scaled(q(fn("nvmlDeviceGetEnforcedPowerLimit"), handle), 1e-3),
            temp_c=q(fn("nvmlDeviceGetTemperature"), handle, self._const("NVML_TEMPERATURE_GPU")),
            sm_clock_mhz=q(fn("nvmlDeviceGetClockInfo"), handle, self._const("NVML_CLOCK_SM")),
            mem_clock_mhz=q(fn("nvmlDeviceGetClockInfo"), handle, self._const("NVML_CLOCK_MEM")),
            # NVML reports PCIe throughput in KB/s over a 20 ms window
            pcie_tx_bps=_scaled(q(fn("nvmlDeviceGetPcieThroughput"), handle,
                                  self._const("NVML_PCIE_UTIL_TX_BYTES")), 1024),
            pcie_rx_bps=_scaled(q(fn("nvmlDeviceGetPcieThroughput"), handle,
                                  self._const("NVML_PCIE_UTIL_RX_BYTES")), 1024),
            processes=tuple(
                ProcessSample(pid=int(p.pid), name=_process_name(int(p.pid)),
                              used_bytes=NA if getattr(p, "usedGpuMemory", None) is None else p.usedGpuMemory)
                for p in procs
            ),
            cc=CCState(
                **cc_system,
                protected_mem_kib=NA if cc_mem is NA else cc_mem.protectedMemSizeKib,
                unprotected_mem_kib=NA if cc_mem is NA else cc_mem.unprotectedMemSizeKib,
            ),
        )
