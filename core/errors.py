"""The one error tree, re-exported for the engine (defined in ``core.protocol.errors``)."""

from gputravel.core.protocol.errors import (  # noqa: F401
    AgentError,
    AttestationError,
    CancelledRunError,
    ConfigError,
    DataError,
    DeviceError,
    FrameError,
    GpuTravelError,
    IntegrityError,
    LedgerError,
    LinkLostError,
    NonceExhaustedError,
    ProtocolError,
    ReplayError,
    StaleEpochError,
    TagError,
    WindowError,
    error_from_code,
)

__all__ = [
    "AgentError", "AttestationError", "CancelledRunError", "ConfigError", "DataError", "DeviceError", "FrameError",
    "GpuTravelError", "IntegrityError", "LedgerError", "LinkLostError", "NonceExhaustedError", "ProtocolError",
    "ReplayError", "StaleEpochError", "TagError", "WindowError", "error_from_code",
]
