"""The device's public counters (telemetry) over a short connection of their own, beside the control channel."""

from __future__ import annotations

import socket
from typing import Any

from gputravel.core.errors import DeviceError
from gputravel.core.protocol import FrameType, read_frame
from gputravel.core.protocol.devicelink import send_frame

__all__ = ["read_counters"]


def read_counters(socket_path: str, *, timeout: float = 2.0) -> dict[str, Any]:
    """The device's public counters over a short connection of their own: no session, no lock shared
    with the control channel, so telemetry keeps ticking while the device trains."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            send_frame(sock, FrameType.PING, {"counters": True})
            with sock.makefile("rb") as stream:
                frame = read_frame(stream)
    except OSError as exc:
        raise DeviceError(f"cannot read the device's counters: {exc}") from None
    if frame is None or frame.type is not FrameType.PONG:
        raise DeviceError("the device did not answer the counters request")
    return dict(frame.header)
