"""Which copy of a HANDOFF the agent takes (issue 34 item 2): a part of ``Agent``.

A HANDOFF may reach the agent twice: over its holder link and relayed by the device on its parked data connection
(with the window's request, or by ``Op.RELAY``), both with the same ``relay_id``. The first copy is taken and the
other skipped. A relayed copy is taken only by an attesting agent, for the epoch and key its last ok verdict
attested, wrapped for it; anything else relayed (another holder's hand-off, a stale epoch, a bare key, a
malformed header) is ignored and counted, with nothing answered: the holder link's copy decides.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import TYPE_CHECKING

from gputravel.core.protocol.holderlink import Handoff

if TYPE_CHECKING:
    from gputravel.agents.holder.attest import HolderAttestation

__all__ = ["RelayedCopies"]


class RelayedCopies:
    """The relay ids of the HANDOFFs taken (the last 16) and how many relayed copies were ignored."""

    __slots__ = ("ignored", "name", "taken")

    def __init__(self, name: str) -> None:
        self.name = name
        self.taken: deque[str] = deque(maxlen=16)
        self.ignored = 0

    def take(self, h: Handoff, *, relayed: bool, attestation: HolderAttestation | None) -> bool:
        """Whether this copy of ``h`` is the one to provision (its ``relay_id`` is then remembered): not the other
        copy of one taken already, and, ``relayed``, what ``attestation``'s last ok verdict is for."""
        if h.relay_id is not None and h.relay_id in self.taken:
            return False  # the other copy of a hand-off already taken
        if relayed and (attestation is None or h.relay_id is None or not attestation.expects(h)):
            self.ignore(f"epoch {h.epoch} is not the hand-off this agent attested")
            return False
        if h.relay_id is not None:
            self.taken.append(h.relay_id)
        return True

    def ignore(self, why: str) -> None:
        self.ignored += 1
        print(f"gputravel agent {self.name}: a relayed hand-off ignored: {why}; the holder link's copy decides",
              file=sys.stderr)
