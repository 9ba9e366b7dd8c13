"""Telemetry sources: NVML, emulated device counters, replay."""
