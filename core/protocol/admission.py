"""A data connection's credential (``Admission``, in its first DATA_OPEN): who speaks, for which window.

``mac`` is ``keys.admission_mac`` under the window's admission key (HKDF of its provisioning key, label
``keys.ADMIT_LABEL``) over a fresh ``nonce`` (the device admits a nonce once per window), the session, the
epoch and the holder's name. ``from_wire`` raises ``FrameError`` for anything malformed, like every message
of ``holderlink``; the device's side is core/device/admission.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.keys import ADMIT_MAC_LEN, ADMIT_NONCE_LEN, admission_key, admission_mac

__all__ = ["Admission"]

_U64 = (1 << 64) - 1
_MAX_HOLDER = 256


def _hexfield(h: Mapping[str, Any], name: str, nbytes: int) -> str:
    value = h.get(name)
    if not isinstance(value, str):
        raise FrameError(f"DATA_OPEN admit {name!r} must be a hex string")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise FrameError(f"DATA_OPEN admit {name!r} is not hex") from None
    if len(raw) != nbytes:
        raise FrameError(f"DATA_OPEN admit {name!r} must be {nbytes} bytes, not {len(raw)}")
    return value


@dataclass(frozen=True, slots=True)
class Admission:
    """It speaks for ``holder`` in the window of ``epoch`` (see the module's text)."""

    epoch: int
    holder: str
    nonce: str  # hex, ADMIT_NONCE_LEN bytes
    mac: str  # hex, ADMIT_MAC_LEN bytes

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "holder": self.holder, "nonce": self.nonce, "mac": self.mac}

    @classmethod
    def from_wire(cls, h: Any) -> Admission:
        if not isinstance(h, Mapping):
            raise FrameError("DATA_OPEN admit is not an object")
        epoch, holder = h.get("epoch"), h.get("holder")
        if type(epoch) is not int or not 1 <= epoch <= _U64:
            raise FrameError(f"DATA_OPEN admit 'epoch' must be an integer in 1..{_U64}")
        if not isinstance(holder, str) or len(holder) > _MAX_HOLDER:
            raise FrameError(f"DATA_OPEN admit 'holder' must be a string of at most {_MAX_HOLDER} characters")
        return cls(epoch=epoch, holder=holder, nonce=_hexfield(h, "nonce", ADMIT_NONCE_LEN),
                   mac=_hexfield(h, "mac", ADMIT_MAC_LEN))

    @classmethod
    def make(cls, key: bytes, *, session_id: bytes, epoch: int, holder: str) -> Admission:
        """The credential for a connection: ``key`` is the window's provisioning key (its bytes)."""
        nonce = os.urandom(ADMIT_NONCE_LEN)
        mac = admission_mac(admission_key(key), nonce=nonce, session_id=session_id, epoch=epoch, holder=holder)
        return cls(epoch, holder, nonce.hex(), mac.hex())
