"""The hardware seam: ``emulated`` (the default everywhere). What NVML says about a real GPU's CC mode is
read by ``gputravel.core.telemetry`` (``gputravel telemetry``); running the protocol on CC-mode hardware
needs NVIDIA's CC driver and attestation SDK, which this project does not ship."""

from gputravel.core.platform.base import DeviceHandle, PlatformInfo
from gputravel.core.platform.emulated import EmulatedPlatform

__all__ = ["DeviceHandle", "PlatformInfo", "EmulatedPlatform"]
