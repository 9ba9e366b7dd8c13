"""Telemetry values: frozen snapshots, with "not available" as a value of its own.

``NA`` prints ``N/A`` (also through format specs, so ``f"{sample.power_w:.0f} W"`` never raises)
and becomes ``null`` in JSON. A snapshot holds only plain values: no NVML handles, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Final


class NAType:
    """The one "not available" value: falsy, prints ``N/A``, JSON ``null``."""

    _instance: NAType | None = None
    __slots__ = ()

    def __new__(cls) -> NAType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __format__(self, spec: str) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NA"


NA: Final = NAType()

#: A number, or NA where the source cannot say.
Num = float | int | NAType


def _plain(value: Any) -> Any:
    """NA to None, tuples of snapshots to lists of dicts (for JSON and the recording)."""
    if value is NA:
        return None
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _na(value: Any) -> Any:
    return NA if value is None else value


@dataclass(frozen=True, slots=True)
class CCState:
    """Confidential-computing state as NVML reports it (system-wide, plus this device's memory split)."""

    feature: str | NAType = NA  # "on" | "off"
    devtools: str | NAType = NA  # "on" | "off"
    environment: str | NAType = NA  # "prod" | "sim" | "unavailable"
    gpus_ready: bool | NAType = NA  # the system accepts client work (GPUs ready state)
    protected_mem_kib: Num = NA
    unprotected_mem_kib: Num = NA

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CCState:
        return cls(**{k: _na(v) for k, v in (data or {}).items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class ProcessSample:
    pid: int
    name: str | NAType = NA
    used_bytes: Num = NA

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": _plain(self.name), "used_bytes": _plain(self.used_bytes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessSample:
        return cls(pid=int(data["pid"]), name=_na(data.get("name")), used_bytes=_na(data.get("used_bytes")))


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One device at one instant. Rates are bytes per second; power in watts; clocks in MHz."""

    index: int
    name: str
    uuid: str | NAType = NA
    sim: bool = False
    util_gpu: Num = NA  # percent
    util_mem: Num = NA  # percent
    mem_used: Num = NA  # bytes
    mem_total: Num = NA  # bytes
    power_w: Num = NA
    power_limit_w: Num = NA
    temp_c: Num = NA
    sm_clock_mhz: Num = NA
    mem_clock_mhz: Num = NA
    pcie_tx_bps: Num = NA  # device -> host
    pcie_rx_bps: Num = NA  # host -> device
    rx_bytes: Num = NA  # host -> device so far (SIM: ciphertext the device accepted into its memory)
    processes: tuple[ProcessSample, ...] = ()
    cc: CCState = field(default_factory=CCState)
    note: str | None = None  # why a SIM or degraded sample lacks fields

    @property
    def key(self) -> str:
        return f"sim-{self.index}" if self.sim else f"gpu-{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuSample:
        kw: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name not in data:
                continue
            value = data[name]
            if name == "processes":
                kw[name] = tuple(ProcessSample.from_dict(p) for p in value or ())
            elif name == "cc":
                kw[name] = CCState.from_dict(value)
            elif name in ("index", "name", "sim", "note"):
                kw[name] = value
            else:
                kw[name] = _na(value)
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class NvmlStatus:
    """Whether NVML answered, and if not, why (shown to the operator instead of a crash)."""

    available: bool
    reason: str | None = None
    driver_version: str | NAType = NA
    nvml_version: str | NAType = NA
    cuda_driver_version: Num = NA
    device_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> NvmlStatus:
        data = data or {"available": False, "reason": "not recorded"}
        return cls(**{k: (_na(v) if k not in ("available", "reason", "device_count") else v)
                      for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class TelemetryFrame:
    """Everything the telemetry sources said at one tick, tagged with the protocol phase that ran."""

    t: float
    source: str  # "nvml" | "emulated" | "replay" | "none"
    nvml: NvmlStatus
    devices: tuple[GpuSample, ...] = ()
    phase: str | None = None  # e.g. "bob · PROVISION"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "t": self.t, "phase": self.phase, "nvml": self.nvml.to_dict(),
                "devices": [d.to_dict() for d in self.devices]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TelemetryFrame:
        return cls(t=float(data.get("t", 0.0)), source=str(data.get("source", "replay")),
                   nvml=NvmlStatus.from_dict(data.get("nvml")),
                   devices=tuple(GpuSample.from_dict(d) for d in data.get("devices", ())),
                   phase=data.get("phase"))

    def replace(self, **changes: Any) -> TelemetryFrame:
        from dataclasses import replace

        return replace(self, **changes)
