"""Holder links: how the engine reaches a holder's agent, as one interface.

``HolderLink`` is every member the engine uses, ``HolderState`` the per-host states, ``HolderInfo``
what an agent's HELLO said, ``ProvisionStats`` what a hand-off moved. The links themselves live beside
this module: ``framed_link.FramedSession`` speaks the framed protocol over any pair of asyncio streams
(and relays ciphertext chunks to the device's data port as they are), a part each link holds;
``local_link.LocalHolderLink`` runs the agent as a local subprocess over stdin/stdout, and the SSH link
(``agents.ssh_holder``) a deployed agent over an SSH channel, both through the same interface.

The messages on a holder link are typed (``core.protocol.holderlink``: ``Hello``, ``Handoff``,
``Progress``, ``Refusal``, ``Done``, ``Bye``); ``Handoff`` is re-exported here.

Who holds the key. The orchestrator is trusted with the holders' keys (holders trust it; see the
design's actors): it holds the session's master secret, from which the device derives every
provisioning key, and for each hand-off it receives that hand-off's ``ProvisioningKey`` from the
device (``DeviceClient.handoff``, inside the sealed control channel), puts it in the ``Handoff`` and
forwards it to the holder inside the encrypted holder link; on the conventional path it keeps the key
and seals the holder's plaintext under it itself (``framed_link._BounceSealer``). What it does not do
is open the sealed chunks on the direct and channel paths, and a key is useless after its holder
returns (the device closes the window and refuses its epoch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from gputravel.core.errors import LinkLostError
from gputravel.core.protocol.holderlink import DataEndpoint, Handoff, Hello

__all__ = ["DataEndpoint", "Handoff", "HolderInfo", "HolderLink", "HolderState", "ProgressFn", "ProvisionStats",
           "RejectFn", "StateFn"]


class HolderState(StrEnum):
    """Per-host states of a holder link: connecting -> deploying -> verified -> ready -> provisioning ->
    returned, or failed / offline; stopped when the run lets it go."""

    CONNECTING = "connecting"
    DEPLOYING = "deploying"
    VERIFIED = "verified"
    READY = "ready"
    PROVISIONING = "provisioning"
    RETURNED = "returned"
    FAILED = "failed"
    OFFLINE = "offline"
    STOPPED = "stopped"


#: (holder, state, detail): how a link reports its per-host state to the engine
StateFn = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class HolderInfo:
    name: str
    fmt: str
    train_bytes: int
    val_bytes: int
    files: int
    agent_sha256: str
    transport: str
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hello(cls, name: str, hello: Hello, *, transport: str) -> HolderInfo:
        """What the engine keeps of an agent's HELLO (``name``: the holder as the engine calls it)."""
        return cls(name=name, fmt=hello.fmt, train_bytes=hello.train_bytes, val_bytes=hello.val_bytes,
                   files=hello.files, agent_sha256=hello.agent_sha256, transport=transport)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "format": self.fmt, "train_bytes": self.train_bytes, "val_bytes": self.val_bytes,
                "files": self.files, "agent_sha256": self.agent_sha256, "transport": self.transport, **self.detail}


@dataclass(slots=True)
class ProvisionStats:
    nbytes: int = 0
    chunks: int = 0
    retransmits: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    #: the agent's own seconds per stage of this hand-off (``read_seal_s``, ``wait_s``), from its DONE
    stages: dict[str, float] = field(default_factory=dict)
    #: the orchestrator's side of the hand-off's fixed cost, ``perf_counter_ns`` when each step ended:
    #: ``attest_begun``, ``attest_sent`` (evidence built), ``verdict`` (the holder's VERDICT read),
    #: ``handoff_sent``, ``done`` (the agent's DONE read) (``handoff.fixed_stages`` puts them beside the
    #: device's ``WindowClosed.marks_ns``)
    marks_ns: dict[str, int] = field(default_factory=dict)
    #: the holder's verdict was fetched ahead (``prefetch_attestation``), while the visit before trained or during
    #: this visit's ATTEST phase (the rest of a fetch still under way is this hand-off's ``verdict`` stage)
    attest_prefetched: bool = False
    #: the device wrote the HANDOFF on the agent's parked data connection (``FramedSession.relay``); a copy went
    #: over the holder link all the same, and the agent took whichever came first
    relayed: bool = False


ProgressFn = Callable[[int], None]
RejectFn = Callable[[int | None, str, str], None]


class HolderLink(ABC):
    """How the engine reaches one holder: start its agent, provision a hand-off, resume after a dropped
    link, close; ``on_state`` reports its ``HolderState`` changes."""

    name: str
    #: "SEQ:HASH" of the ledger when the run lets the holder go: sent with the farewell, for its witness
    farewell_head: str | None = None
    #: this holder's visits' ledger rows by epoch (``(seq, hash)``): sent with the farewell, for its receipts
    farewell_rows: Mapping[int, tuple[tuple[int, str], ...]] = MappingProxyType({})
    #: the engine's callback for per-host state changes (set by the engine when the link has none)
    on_state: StateFn | None = None
    #: per-host state (connecting -> ... -> ready -> provisioning -> returned / failed / offline) and its detail
    state: str = HolderState.OFFLINE
    state_detail: str = ""
    #: how often a dropped link may be re-established within one hand-off (0: it cannot reconnect)
    max_reconnects: int = 0

    def set_state(self, state: str, detail: str = "") -> None:
        """This holder's state changed: kept, and told to ``on_state`` (holder, state, detail)."""
        self.state, self.state_detail = state, detail
        if self.on_state is not None:
            self.on_state(self.name, state, detail)

    @abstractmethod
    async def start(self) -> HolderInfo: ...

    @abstractmethod
    async def provision(self, handoff: Handoff, *, device_socket: str, on_progress: ProgressFn | None = None,
                        on_reject: RejectFn | None = None,
                        data_endpoint: DataEndpoint | None = None) -> ProvisionStats: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def reconnect(self) -> HolderInfo:
        """Re-establish a dropped link and restart the agent (links with ``max_reconnects > 0``)."""
        raise LinkLostError(self.name, "this link cannot reconnect")

    @property
    def ready(self) -> bool:
        """Verified-ready: the agent this link verified is still there and waiting. The engine hands a key
        (opens a provisioning window) only to a holder that is ready."""
        return True

    async def ensure_ready(self) -> HolderInfo | None:
        """Bring a holder that is not :attr:`ready` back (restart, or reconnect with backoff and verify the
        agent again), or raise ``AgentError``; the new agent's ``HolderInfo`` (None: nothing changed)."""
        return None

    async def kill(self) -> None:
        """Fault injection: the agent dies."""
        raise NotImplementedError

    def prefetch_attestation(self, *, epoch: int, key_fp: str) -> None:
        """Start this holder's attestation of the hand-off of key ``key_fp`` in ``epoch`` now, in the background
        (while another visit trains); its hand-off uses the verdict if the key is that one. Links whose agents
        do not attest ignore it."""
        return None

    async def settle_attestation(self) -> None:
        """Wait for an attestation ``prefetch_attestation`` started (before the link reads anything else)."""
        return None
