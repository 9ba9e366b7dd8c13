"""The one open provisioning window of the device's windows part (:mod:`gputravel.core.device.window`): which
bytes of the buffer which key may write in which epoch, the chunks accepted and in flight, and the hand-off's
first events by stage. A module of its own so that the data connections' admission can read it without importing
the windows part (which holds the data plane, which holds the admissions)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gputravel.core.protocol import DirectionKey, RecvState

__all__ = ["ProvisionWindow"]


@dataclass(slots=True)
class ProvisionWindow:
    """The one open hand-off: which bytes of the buffer which key may write, in which epoch."""

    epoch: int
    offset: int
    length: int
    chunk_size: int
    fingerprint: str
    recv: RecvState
    accepted: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    bytes_in: int = 0
    contig: int = 0
    tags: set[bytes] = field(default_factory=set)  # GCM tags of the accepted chunks (public, not key material)
    key: DirectionKey | None = None  # for a chunk opener that needs the raw key (the GPU cipher)
    #: when the window opened (``perf_counter_ns``) and, in ns after it, its hand-off's first events: a data
    #: connection ``admitted``, a shared-memory ring ``ring_bound``, the ``first_chunk`` (and the ``last_chunk``)
    #: in device memory
    #: (``WindowClosed.marks_ns``: the hand-off's fixed cost by stage, ``handoff.fixed_stages``)
    opened_ns: int = field(default_factory=time.perf_counter_ns)
    marks: dict[str, int] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        """The first time ``name`` happens in this window (callers hold the service's lock)."""
        if name not in self.marks:
            self.marks[name] = time.perf_counter_ns() - self.opened_ns

    @property
    def n_chunks(self) -> int:
        return (self.length + self.chunk_size - 1) // self.chunk_size

    def contiguous(self) -> int:
        """Number of chunks accepted without a gap from the start (the resume point)."""
        while self.contig in self.accepted:
            self.contig += 1
        return self.contig
