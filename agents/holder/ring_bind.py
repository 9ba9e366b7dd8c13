"""A kept data connection's shared-memory ring bound to a hand-off's epoch: a part of the agent's provisioning
(``Provisioner._data_conn``)."""

from __future__ import annotations

import os
import queue
import sys
from collections.abc import Callable
from typing import Any

from gputravel.agents.holder.dataconn import DataConn, DataLinkLost, RingOffer
from gputravel.core.protocol import FrameType
from gputravel.core.protocol.errors import FrameError, GpuTravelError, HolderLinkError, error_from_code
from gputravel.core.protocol.holderlink import Admission, Refusal
from gputravel.core.protocol.shmring import RingSpec, ShmRing

__all__ = ["open_ring"]


def open_ring(conn: DataConn, spec: RingSpec, admit: Admission, inbox: queue.Queue[Any], *, name: str,
              send: Callable[[FrameType, dict[str, Any]], None]) -> ShmRing | None:
    """Ask the device to bind ``conn``'s ring to this epoch (it sends the ring's descriptor the first time, or for
    another shape); None (chunks go in socket frames) if it declines. ``inbox``: the agent's; ``send``: a frame on
    its holder link (a PING met meanwhile is answered).

    A connection that already maps a ring of this shape does not wait for the answer: the device reads
    this connection in order, so the bind is done before it reads the first chunk's slot id, and the
    agent seals meanwhile (the round trip, about a quarter of a millisecond, leaves the hand-off's fixed
    cost). The answer is checked when it comes (``DataConn.confirm_ring``); a refusal fails the
    hand-off, and the chunks already announced are refused by the device as for an unbound ring."""
    conn.request_ring(spec, admit)
    if conn.ring is not None and not conn.ring.closed and conn.ring.same_shape(spec):
        conn.ring.bind(epoch=spec.epoch)
        conn.awaiting = spec
        return conn.ring
    while True:
        item = inbox.get()
        if isinstance(item, RingOffer) and item.conn is conn:
            try:
                if item.ready.ring != spec:
                    raise FrameError(f"the device offered ring {item.ready.ring}, not {spec}")
                if item.fd >= 0:
                    conn.set_ring(ShmRing.attach(item.fd, spec))
                elif conn.ring is None or not conn.ring.same_shape(spec):
                    raise FrameError("the device reuses a ring this connection does not have")
                assert conn.ring is not None
                conn.ring.bind(epoch=spec.epoch)
                return conn.ring
            except GpuTravelError as exc:
                if item.fd >= 0 and conn.ring is None:
                    os.close(item.fd)
                raise HolderLinkError(f"the device's ring is unusable: {exc.reason}") from None
        if isinstance(item, DataLinkLost):
            if item.conn is conn:
                raise item
            continue
        if isinstance(item, GpuTravelError):
            raise item
        if item is None or isinstance(item, Exception):
            inbox.put(item)
            raise GpuTravelError("link closed during provisioning")
        if item.type is FrameType.ERROR and item.header.get("ring"):
            refusal = Refusal.from_wire(item.header)
            if refusal.code in ("admission", "stale-epoch", "budget"):
                raise error_from_code(refusal.code,
                                      f"the device refused this hand-off's data connection: {refusal.reason}")
            print(f"gputravel agent {name}: no shared-memory ring ({refusal.reason}); chunks go over the socket",
                  file=sys.stderr)
            return None
        if item.type is FrameType.PING:
            send(FrameType.PONG, item.header)
        elif item.type is FrameType.BYE:
            raise GpuTravelError("orchestrator ended the hand-off")
