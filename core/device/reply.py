"""One operation's answer, as every device operation returns it (the service's and the checkpoint ops')."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Handler", "Reply"]


@dataclass(frozen=True, slots=True)
class Reply:
    """One operation's answer: the response header and payload, and what the transport does after sending
    it (``rekey_to``: swap the control channel to that epoch; ``stop``: close the service)."""

    header: dict[str, Any]
    payload: bytes | bytearray | memoryview = b""
    rekey_to: int | None = None
    stop: bool = False
    #: the payload is already sealed under a key of its own (a checkpoint chunk): the control channel binds
    #: its tag and sends it as it is, without encrypting it again
    attached: bool = False
    #: the operation's work that may follow its answer (run before the next request is read): a window closed in a
    #: relayed HANDOFF's answer has its rings zeroed once the orchestrator knows it is closed
    after: Callable[[], None] | None = None


Handler = Callable[..., Reply]
