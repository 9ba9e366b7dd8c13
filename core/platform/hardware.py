"""The hardware platform seam: what NVML says about confidential computing on this machine.

Running the protocol on a real CC-mode H100 needs NVIDIA's CC-mode driver and attestation SDK
(nvTrust / the NRAS verifier), which this project does not ship. This module only *observes*:
it reports whether a driver is present and what NVML's confidential-compute queries return, and
says plainly what is missing. It never fakes a hardware result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class HardwareStatus:
    nvml_available: bool
    reason: str
    gpus: tuple[str, ...] = ()
    cc: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"nvml_available": self.nvml_available, "reason": self.reason, "gpus": list(self.gpus),
                "cc": dict(self.cc)}


def probe_hardware() -> HardwareStatus:
    """Ask NVML (if there is a driver) for GPUs and the system's confidential-compute state."""
    try:
        import pynvml
    except ImportError:
        return HardwareStatus(False, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound on machines without a driver
        return HardwareStatus(False, f"NVML unavailable: {exc}")
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        cc: dict[str, Any] = {}
        try:
            state = pynvml.nvmlSystemGetConfComputeState()
            cc = {"environment": int(state.environment), "cc_feature": int(state.ccFeature),
                  "dev_tools_mode": int(state.devToolsMode)}
        except (pynvml.NVMLError, AttributeError) as exc:
            cc = {"error": f"confidential-compute query unsupported: {exc}"}
        return HardwareStatus(True, "ok", tuple(names), cc)
    finally:
        pynvml.nvmlShutdown()
