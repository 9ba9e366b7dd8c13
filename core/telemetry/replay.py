"""The replay source: telemetry frames read back from a recording, in recorded order."""

from __future__ import annotations

from collections.abc import Iterable

from gputravel.core.telemetry.model import TelemetryFrame

__all__ = ["ReplaySource"]


class ReplaySource:
    """Yields the recorded frames one at a time; ``source`` reads ``replay`` on each."""

    name = "replay"

    def __init__(self, frames: Iterable[TelemetryFrame]) -> None:
        self.frames = list(frames)
        self.position = 0

    def __len__(self) -> int:
        return len(self.frames)

    def next(self) -> TelemetryFrame | None:
        if self.position >= len(self.frames):
            return None
        frame = self.frames[self.position]
        self.position += 1
        return frame.replace(source="replay")

    def seek(self, position: int) -> None:
        self.position = max(0, min(position, len(self.frames)))
