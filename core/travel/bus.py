"""The engine's one outlet: every event goes to the queues (``subscribe``) and the sinks, every timing to the
probes.

Before, the engine kept three observer lists (``subscribers``, ``sinks``, ``probes``) and looped over each
where it spoke. Now it publishes through one ``EventBus``: ``publish(event)`` for facts (the events of
``core.events``), ``timing`` for the probes' hooks (``EngineProbe``: benchmarks' perf_counter seconds, which
are not facts of the run and never reach the ledger or the console). ``engine.subscribe()``,
``engine.bus.sinks`` and ``engine.bus.probes`` are this bus's.
"""

from __future__ import annotations

import asyncio

from gputravel.core import events as ev
from gputravel.core.phases import Phase
from gputravel.core.travel.control import EventSink
from gputravel.core.travel.probes import EngineProbe

__all__ = ["EventBus", "EventSink"]


class _Fanout(EngineProbe):
    """One probe that calls every attached probe, in the order they were attached."""

    __slots__ = ("_probes",)

    def __init__(self, probes: list[EngineProbe]) -> None:
        self._probes = probes

    def on_holder_started(self, holder: str, started: float, ready: float) -> None:
        for p in self._probes:
            p.on_holder_started(holder, started, ready)

    def on_phase(self, visit: int, phase: Phase, seconds: float) -> None:
        for p in self._probes:
            p.on_phase(visit, phase, seconds)

    def on_checkpoint(self, seq: int, seconds: float) -> None:
        for p in self._probes:
            p.on_checkpoint(seq, seconds)

    def on_visit(self, visit: int, seconds: float) -> None:
        for p in self._probes:
            p.on_visit(visit, seconds)


class EventBus:
    """Queues and sinks hear every published event (queues first); probes hear every timing."""

    __slots__ = ("probes", "queues", "sinks", "timing")

    def __init__(self) -> None:
        #: one per ``subscribe()`` (the console's bridge, ``core.api.events``)
        self.queues: list[asyncio.Queue[ev.Event]] = []
        #: called in line with each event (recorders, trackers, tests)
        self.sinks: list[EventSink] = []
        #: timing hooks (``EngineProbe``): benchmarks attach theirs here
        self.probes: list[EngineProbe] = []
        #: the probes as one: ``bus.timing.on_phase(...)``
        self.timing: EngineProbe = _Fanout(self.probes)

    def subscribe(self) -> asyncio.Queue[ev.Event]:
        q: asyncio.Queue[ev.Event] = asyncio.Queue()
        self.queues.append(q)
        return q

    def publish(self, event: ev.Event) -> None:
        for q in self.queues:
            q.put_nowait(event)
        for sink in self.sinks:
            sink(event)
