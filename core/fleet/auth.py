"""What a fleet's ranks say to each other is authenticated by the run, not by torchrun's store.

torchrun's c10d store and the gloo connections it pairs up take anyone who can reach the port: a store key
can be overwritten by any client, and gloo's peer addresses are store keys, so whoever writes them can stand
in for a rank on the workers' group. Two things keep such an attacker out:

* **The workers' messages** (the agreements before TRAIN, the replicas' digests, the reports) are JSON (never
  pickle: ``all_gather_object`` would unpickle whatever a peer sent) sealed with HMAC-SHA256 under a key
  derived from the **fleet key** (32 random bytes, made by rank 0 and sent wrapped to each worker whose CVM quote
  verified, ``core/fleet/keyagree.py``; never written to any folder). The MAC binds the job's
  restart, the world size, the call's index (so a message is good for one exchange only) and the sender's rank
  (so one rank's message cannot be relabelled as another's). Anything else is a ``FleetAuthError``.
* **The devices' ring** agrees its link keys by attested ECDH over the store (``core/collectives/keys.py``:
  evidence over the peer's fresh nonce, checked against the vendor root); each device also checks that the
  neighbour it attested is the device that neighbour's worker attested (``expected``: the workers exchange
  their devices' ids and key fingerprints over the authenticated worker group), so another genuine GPU
  cannot stand in for a rank.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from gputravel.core.errors import ConfigError, FleetAuthError
from gputravel.core.protocol.wirejson import loads_bounded

__all__ = ["MAX_MESSAGE_BYTES", "open_message", "seal_message"]

KEY_BYTES = 32
TAG_BYTES = 32
#: a worker message's limit (a rank's report is the largest: tens of KiB)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_LABEL = b"gputravel fleet workers v1"


def _tag(key: bytes, context: str, sender: int, body: bytes) -> bytes:
    mac_key = hmac.new(key, _LABEL, hashlib.sha256).digest()
    head = json.dumps([context, sender], separators=(",", ":")).encode()
    return hmac.new(mac_key, len(head).to_bytes(4, "big") + head + body, hashlib.sha256).digest()


def seal_message(key: bytes, *, context: str, sender: int, obj: Any) -> bytes:
    """``obj`` as JSON followed by its tag over (context, sender, JSON)."""
    body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    if len(body) + TAG_BYTES > MAX_MESSAGE_BYTES:
        raise ConfigError(f"a fleet message of {len(body)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return body + _tag(key, context, sender, body)


def open_message(key: bytes, data: bytes, *, context: str, sender: int) -> Any:
    """The object ``sender`` sealed for ``context``, or ``FleetAuthError`` (nothing of it is parsed first)."""
    if not TAG_BYTES < len(data) <= MAX_MESSAGE_BYTES:
        raise FleetAuthError(f"the message from rank {sender} has {len(data)} bytes: not a sealed fleet message")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, context, sender, body)):
        raise FleetAuthError(f"the message from rank {sender} does not authenticate under the fleet key "
                             f"({context}): injected, altered, replayed or another rank's; refused")
    return loads_bounded(body, max_bytes=MAX_MESSAGE_BYTES, what=f"fleet message from rank {sender}")
