"""The hand-off's ways to the agent other than its holder link (issue 34 item 2), a part of ``FramedSession``.

Between a holder's windows its agent's data connection stays parked at the device, bound to that holder by its
last admission. The device can write the agent's next HANDOFF (its key wrapped for the agent by the orchestrator)
on it, so the hand-off does not cross the holder's SSH link:

- **with the window request** (``prepare``, ``RunSettings.handoff_with_window``): the orchestrator knows the key a
  window will get before it opens (it shares the session's master secret with the device), so where the holder's
  ok verdict for that very epoch and key was fetched ahead, the HANDOFF is wrapped before the window is asked for
  and goes with the request (``Op.HANDOFF``'s ``relay``); the device opens the window, checks that the HANDOFF is
  of that window's epoch and key, and writes it on the parked connection before it answers. One orchestrator ->
  device message replaces the window's request and the relay's;
- **after the window opened** (``send``, ``RunSettings.handoff_relay``): ``Op.RELAY`` with the wrapped HANDOFF.

Either way the same HANDOFF (one ``relay_id``) then goes over the holder link too: the record and the fallback
(the agent takes the first copy, a relayed one only for the epoch and key its own last ok verdict attested).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gputravel.core.errors import GpuTravelError
from gputravel.core.protocol.holderlink import Handoff

__all__ = ["Early", "HandoffRelay", "RelayFn", "relayable"]

#: ``relay(holder, epoch, handoff_header)``: the device writes the HANDOFF on the holder's parked data connection
#: (``DeviceClient.relay``; blocking, run in a worker thread); whether it was written
RelayFn = Callable[[str, int, dict[str, Any]], bool]


def relayable(h: Handoff) -> bool:
    """Whether the device may carry ``h``: its key is wrapped for the attested agent (a bare key never leaves the
    holder link) and its data connection is the device's Unix socket on this host (the TCP data port is not
    encrypted: there the HANDOFF's fields stay on the SSH link)."""
    return h.wrapped_key is not None and h.key is None and h.data_endpoint is not None \
        and h.data_endpoint.path is not None


@dataclass(slots=True)
class Early:
    """A HANDOFF wrapped before its window opened: ``base`` is the hand-off it was wrapped from (the link's copy
    goes only for that very hand-off), ``outgoing`` what goes to the agent, ``delivered`` whether the device wrote
    it on the parked connection as it opened the window (None: not asked yet, or, for a request answered at the
    window's completion, core/travel/completion.py, not answered yet)."""

    base: Handoff
    outgoing: Handoff
    delivered: bool | None = None


class HandoffRelay:
    """One holder link's relay state: the device's ``Op.RELAY`` (``fn``, set by the engine; None: off), whether the
    agent keeps a data connection parked (its last direct hand-off ended well: only then is a relay tried), and a
    HANDOFF prepared for its window's request (``early``)."""

    __slots__ = ("early", "fn", "parked")

    def __init__(self) -> None:
        self.fn: RelayFn | None = None
        self.parked = False
        self.early: Early | None = None

    def reset(self) -> None:
        """A new agent, or a failed hand-off: no connection parked, nothing prepared."""
        self.parked, self.early = False, None

    def prepare(self, base: Handoff, wrapped: Handoff) -> Early | None:
        """``wrapped`` (``base`` with its key wrapped for the attested agent) for the window's request, with a fresh
        ``relay_id``; None where it may not go so (no parked connection, a key that is not wrapped, not the Unix
        socket)."""
        self.early = None
        if not self.parked or not relayable(wrapped):
            return None
        self.early = Early(base, replace(wrapped, relay_id=os.urandom(8).hex()))
        return self.early

    def take(self, handoff: Handoff) -> Early | None:
        """The HANDOFF prepared for ``handoff``, if the window's request carried it (its answer came back for this
        very hand-off: a resumed hand-off, or another key, is wrapped afresh); it is taken once."""
        early, self.early = self.early, None
        if early is None or early.delivered is None or early.base != handoff:
            return None
        return early

    async def send(self, name: str, outgoing: Handoff) -> tuple[Handoff, bool]:
        """``Op.RELAY``: the device writes ``outgoing`` (with a fresh ``relay_id``) on ``name``'s parked data
        connection; whether it did (False where relaying is off, nothing is parked, the connection is gone or the
        device refused: the copy over the holder link then carries it alone)."""
        if self.fn is None or not self.parked or not relayable(outgoing) or outgoing.relay_id is not None:
            return outgoing, False
        outgoing = replace(outgoing, relay_id=os.urandom(8).hex())
        try:
            return outgoing, await asyncio.to_thread(self.fn, name, outgoing.epoch, outgoing.to_wire())
        except (GpuTravelError, OSError):
            return outgoing, False
