"""A checkpoint the device seals into a shared-memory ring (``core.protocol.ckptring``), drained on this side
without the control link: ``DeviceClient.checkpoint_begin`` gives one, ``checkpoint_end`` closes it."""

from __future__ import annotations

from collections.abc import Callable

from gputravel.core.errors import FrameError
from gputravel.core.protocol.ckptring import CheckpointRing
from gputravel.core.protocol.stream import StreamHeader

__all__ = ["RingCheckpoint"]


class RingCheckpoint:
    """A checkpoint the device seals into a shared-memory ring; this side drains it (no control link)."""

    def __init__(self, ring: CheckpointRing, header: StreamHeader, *, chunks: int, snapshot_s: float) -> None:
        self.ring, self.header, self.chunks, self.snapshot_s = ring, header, chunks, snapshot_s
        self.received = 0

    def drain(self, sink: Callable[[int, memoryview], None], *, timeout: float = 600.0,
              alive: Callable[[], bool] | None = None) -> None:
        """Hand every sealed chunk, in order, to ``sink(kind, sealed)`` (a view of the ring's slot, valid
        during the call); a failure here (the sink's, or a bad slot) tells the device to stop."""
        try:
            for i in range(self.received, self.chunks):
                kind, sealed = self.ring.get(i, timeout=timeout, alive=alive)
                if (kind == 1) != (i == self.chunks - 1) or len(sealed) > self.header.max_sealed:
                    raise FrameError(f"the device sealed a bad checkpoint chunk {i} (kind {kind}, {len(sealed)} bytes)")
                try:
                    sink(kind, sealed)
                finally:
                    sealed.release()
                self.ring.done(i)
                self.received = i + 1
        except BaseException:
            self.ring.abort()
            raise

    def abort(self) -> None:
        self.ring.abort()
