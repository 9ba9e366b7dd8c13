"""A data connection's credential (``Admission``, in its first DATA_OPEN): who speaks, for which window.

``mac`` is ``keys.admission_mac`` under the window's admission key (HKDF of its provisioning key, label
``keys.ADMIT_LABEL``) over a fresh ``nonce`` (the device admits a nonce once per window), the session, the
epoch and the holder's name. ``from_wire`` raises ``FrameError`` for anything malformed, like every message
of ``holderlink`` (declared on the same wire base, ``FrameMessage``); the device's side is core/device/admission.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gputravel.core.protocol.keys import ADMIT_MAC_LEN, ADMIT_NONCE_LEN, admission_key, admission_mac
from gputravel.core.protocol.wire import MAX_U64, FrameMessage, Hex, Int, Str, bounds

__all__ = ["Admission"]

_MAX_HOLDER = 256


@dataclass(frozen=True, slots=True)
class Admission(FrameMessage):
    """It speaks for ``holder`` in the window of ``epoch`` (see the module's text)."""

    epoch: int = field(metadata=bounds(Int(1, MAX_U64)))
    holder: str = field(metadata=bounds(Str(_MAX_HOLDER)))
    nonce: str = field(metadata=bounds(Hex(2 * ADMIT_NONCE_LEN)))
    mac: str = field(metadata=bounds(Hex(2 * ADMIT_MAC_LEN)))

    @classmethod
    def make(cls, key: bytes, *, session_id: bytes, epoch: int, holder: str) -> Admission:
        """The credential for a connection: ``key`` is the window's provisioning key (its bytes)."""
        nonce = os.urandom(ADMIT_NONCE_LEN)
        mac = admission_mac(admission_key(key), nonce=nonce, session_id=session_id, epoch=epoch, holder=holder)
        return cls(epoch, holder, nonce.hex(), mac.hex())
