"""The hardware seam. ``emulated`` (default everywhere) and ``hardware`` (NVML CC-mode queries)."""

from gputravel.core.platform.base import DeviceHandle, PlatformInfo
from gputravel.core.platform.emulated import EmulatedPlatform
from gputravel.core.platform.hardware import HardwareStatus, probe_hardware

__all__ = ["DeviceHandle", "PlatformInfo", "EmulatedPlatform", "HardwareStatus", "probe_hardware"]
