"""The holder link's vocabulary: every header the agent, the orchestrator and the device's data port
exchange about a hand-off, as frozen typed messages.

Two links speak it. The *holder link* (orchestrator <-> agent, stdin/stdout or an SSH channel)::

    agent -> HELLO     Hello        who the agent is, what data it holds, the hash of its own bundle (an
                                    attesting agent adds its first nonce and its key-exchange key)
    orch  -> ATTEST    Attest       the orchestrator CVM's TDX quote and the GPU's SPDM evidence for one
                                    hand-off, under the holder's nonce bound to the window's key
    agent -> VERDICT   Verdict      the holder's verdict on them (and its nonce for the next hand-off);
                                    only after an ok verdict does the HANDOFF carry the key (wrapped)
    orch  -> HANDOFF   Handoff      one window of one epoch, with its ProvisioningKey (never on the
                                    conventional path) and, on the direct path, the device's DataEndpoint
    agent -> ACK       Progress     chunks the device acknowledged since the last report (direct path)
    agent -> ERROR     Refusal      a chunk the device refused (direct path), or the hand-off failed
    agent -> DONE      Done         the window is sent: counts and the agent's stage times
    orch  -> BYE       Bye          the run lets the agent go (with the ledger head for its witness)

and the *data connection* (agent -> device's data port, the direct path)::

    agent -> DATA_OPEN   DataOpen   open a connection for one hand-off's window, admitted by its
                                    Admission (a MAC under the window's key; asking for rings and its
                                    first ring), or bind a shared-memory ring to that window's epoch
    device -> DATA_READY DataReady  the answer (the ring's descriptor rides along, SCM_RIGHTS)

Each message is declared on the wire base (``core/protocol/wire.py``: a ``FrameMessage``, every field with its
bounds and wire name), so ``to_wire()`` (its frame header) and the validating ``from_wire(header)`` come from
the declarations once; ``from_wire`` raises ``FrameError`` (a ``WireFormatError`` of code ``frame`` naming the
message and the field) for a missing field, a wrong type or a number out of range, and the checks that span
fields (a window inside its visit, a key of the hand-off's epoch) are each message's ``validated``: nothing
reads a peer's header by hand, and a malformed one is charged to whoever sent it. Unknown keys are ignored,
so a field added later (a data connection's admission credential, say) is one line here and old peers keep
working. Optional fields are left off the wire while they hold their default (``sparse``), so the headers
are the ones the hand-written forms wrote. The headers themselves were decoded with ``wirejson``'s size and
depth limits.

``ProvisioningKey`` is the one typed form of a hand-off's key (a ``DirectionKey`` whose ``repr`` shows
its fingerprint, never its bytes): derived by the device (``BufferWindows.op_handoff``), sent to the
orchestrator inside the sealed control channel (``HandoffGrant``), carried in the orchestrator's
``Handoff`` and forwarded to the agent inside the holder link, where ``SendState`` seals with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gputravel.core.protocol.admission import Admission
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.errors import FrameError, WireFormatError
from gputravel.core.protocol.frames import FrameType
from gputravel.core.protocol.holderattest import POLICY_SOURCES, Attest, Verdict
from gputravel.core.protocol.keys import KEY_LEN, PREFIX_LEN, DirectionKey
from gputravel.core.protocol.shmring import RingSpec
from gputravel.core.protocol.wire import (
    MAX_FLOAT,
    Flag,
    Float,
    FrameMessage,
    Hex,
    Int,
    MapOf,
    Nested,
    Opt,
    Spec,
    Str,
    TupleOf,
    bounds,
)

__all__ = ["MAX_BYE_ROWS", "MAX_CHUNK", "Admission", "Attest", "Bye", "DataEndpoint", "DataOpen", "DataReady", "Done", "Handoff",
           "Hello", "KeySpec", "KeyWire", "POLICY_SOURCES", "Progress", "ProvisioningKey", "Refusal", "TOKEN_FORMATS", "Verdict"]

#: The largest chunk a hand-off may ask for (the device's limit too).
MAX_CHUNK = 16 * 1024 * 1024
#: Token formats a holder's dataset may have: byte tokens (.txt) or llm.c's uint16 or uint32 shards (.bin).
TOKEN_FORMATS = ("byte", "u16", "u32")
#: the most ledger rows a BYE may return to one holder (its visits' rows; the header's 1 MiB bounds it too)
MAX_BYE_ROWS = 8192

_TEXT = 4096  # a readable ceiling for text fields (names, reasons, heads): a header is at most 16 KiB anyway
_SESSION = Hex(max_len=128)
_RANGE = TupleOf((Int(), Int()))  # [start, length]


# --- the key -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyWire(FrameMessage):
    """A provisioning key's wire form (hex): 32 key bytes, a 4-byte nonce prefix, the epoch, and the holder ->
    device direction (the only one a hand-off's key may have)."""

    key: str = field(metadata=bounds(Hex(2 * KEY_LEN)))
    prefix: str = field(metadata=bounds(Hex(2 * PREFIX_LEN)))
    epoch: int = field(metadata=bounds(Int()))
    direction: int = field(metadata=bounds(Int(0, 255)))

    def validated(self) -> KeyWire:
        if self.direction != Direction.HOLDER_TO_DEVICE:
            raise FrameError(f"provisioning key is for direction {self.direction}, not holder -> device")
        return self


@dataclass(frozen=True, slots=True, repr=False)
class ProvisioningKey(DirectionKey):
    """The key of one hand-off: AES-256-GCM key and nonce prefix for the holder -> device direction of one
    epoch, valid (the device enforces it) only for writes into that hand-off's buffer window. ``repr`` and
    ``str`` show the epoch and fingerprint, never the key bytes."""

    def __repr__(self) -> str:
        return f"ProvisioningKey(epoch={self.epoch}, fp={self.fingerprint})"

    __str__ = __repr__

    @classmethod
    def of(cls, key: DirectionKey) -> ProvisioningKey:
        """The typed form of a key the device derived (``keys.provisioning_key``)."""
        return cls(key.key, key.prefix, int(key.epoch), int(key.direction))

    def to_wire(self) -> dict[str, object]:
        """Hex form (travels only inside the sealed control channel and the encrypted holder link)."""
        return KeyWire(self.key.hex(), self.prefix.hex(), int(self.epoch), int(self.direction)).to_wire()

    @classmethod
    def from_wire(cls, data: Any, *, where: str = "provisioning key") -> ProvisioningKey:
        """Validate a key's wire form (:class:`KeyWire`); anything else is ``FrameError``."""
        w = KeyWire.from_wire(data, where=where)
        return cls(bytes.fromhex(w.key), bytes.fromhex(w.prefix), w.epoch, w.direction)


@dataclass(frozen=True, slots=True)
class KeySpec(Spec):
    """A field holding a :class:`ProvisioningKey` (its wire form :class:`KeyWire`)."""

    def check(self, value: Any, where: str) -> ProvisioningKey:
        return ProvisioningKey.from_wire(value, where=where)

    def dump(self, value: Any) -> Any:
        return value.to_wire()


# --- holder link: agent -> orchestrator --------------------------------------------------------------
def _opt_hex32() -> Any:
    return field(default=None, metadata=bounds(Opt(Hex(64)), sparse=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(FrameMessage):
    """The agent's first frame: who it is and what it holds (sizes only, never data)."""

    FRAME: ClassVar[FrameType] = FrameType.HELLO
    name: str = field(default="", metadata=bounds(Str(_TEXT)))
    version: str = field(default="", metadata=bounds(Str(_TEXT)))
    fmt: str = field(metadata=bounds(Str(8, choices=frozenset(TOKEN_FORMATS)), wire="format"))
    train_bytes: int = field(metadata=bounds(Int()))
    val_bytes: int = field(metadata=bounds(Int()))
    files: int = field(metadata=bounds(Int(0, 1 << 31)))
    agent_sha256: str = field(metadata=bounds(Hex(64)))
    pid: int | None = field(default=None, metadata=bounds(Opt(Int(0, 1 << 31)), sparse=True))
    #: an attesting agent: its first nonce (hex, 32 bytes) and its X25519 key-exchange key (hex, 32 bytes)
    nonce: str | None = _opt_hex32()
    link_pub: str | None = _opt_hex32()
    #: an attesting agent: the SHA-256 of what it checks (``agents.holder.config.policy_summary``), and whose policy
    #: it is: "holder" (``gputravel holder serve``: the holder's own configuration) or "orchestrator" (issue 30)
    policy_sha256: str | None = _opt_hex32()
    policy_source: str | None = field(default=None, metadata=bounds(
        Opt(Str(16, choices=frozenset(POLICY_SOURCES))), sparse=True))


@dataclass(frozen=True, slots=True)
class Progress(FrameMessage):
    """Direct path: ``chunks`` more chunks acknowledged by the device, the last of them ``seq``."""

    FRAME: ClassVar[FrameType] = FrameType.ACK
    seq: int = field(metadata=bounds(Int(), wire="s"))
    chunks: int = field(default=1, metadata=bounds(Int(1, 1 << 32), wire="n"))


@dataclass(frozen=True, slots=True)
class Refusal(FrameMessage):
    """An ERROR: a refused chunk (``seq`` set), a refused ring bind (``ring``), or the whole hand-off."""

    FRAME: ClassVar[FrameType] = FrameType.ERROR
    code: str = field(default="error", metadata=bounds(Str(64)))
    reason: str = field(default="", metadata=bounds(Str(_TEXT)))
    seq: int | None = field(default=None, metadata=bounds(Opt(Int()), wire="s", sparse=True))
    ring: bool = field(default=False, metadata=bounds(Flag(as_int=True), sparse=True))


@dataclass(frozen=True, slots=True)
class Done(FrameMessage):
    """The agent sent its window: chunks sent under this key, bytes, retransmissions, and its own
    seconds per stage (``read_seal_s``, ``wait_s``, ``setup_s``, ``data_s``)."""

    FRAME: ClassVar[FrameType] = FrameType.DONE
    epoch: int = field(metadata=bounds(Int()))
    chunks: int = field(metadata=bounds(Int()))
    nbytes: int = field(metadata=bounds(Int(), wire="bytes"))
    retransmits: int = field(default=0, metadata=bounds(Int()))
    stages: Mapping[str, float] = field(default_factory=dict, metadata=bounds(
        MapOf(Float(-MAX_FLOAT, MAX_FLOAT), max_len=64, key_len=64)))


# --- holder link: orchestrator -> agent --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DataEndpoint(FrameMessage):
    """Where the agent sends sealed chunks on the direct path: the device's Unix socket (``path``, same
    host) or its TCP data port (``host``, ``port``). ``ring``: the agent may ask for a shared-memory ring
    (only on the Unix socket; ``bench provision``'s ``direct-socket`` path turns it off)."""

    path: str | None = field(default=None, metadata=bounds(Opt(Str(_TEXT)), sparse=True))
    host: str | None = field(default=None, metadata=bounds(Opt(Str(255)), sparse=True))
    port: int | None = field(default=None, metadata=bounds(Opt(Int(1, 65535)), sparse=True))
    ring: bool = field(default=True, metadata=bounds(Flag(), sparse=True))

    def __post_init__(self) -> None:
        if (self.path is None) == (self.host is None or self.port is None):
            raise FrameError("a data endpoint is a socket path or a host and port")


@dataclass(frozen=True, slots=True, kw_only=True)
class Handoff(FrameMessage):
    """One window of one visit for one holder: what the orchestrator sends in HANDOFF.

    ``key`` travels only inside the holder link, and not at all on the conventional path (``conventional``:
    the holder sends plaintext over its link and the orchestrator seals it under ``key`` itself). ``skip``
    and ``length`` say which bytes of the visit's window (its train slice, then its val slice) this key
    covers; ``resume_from`` is the first chunk still to send. ``repr`` never shows the key. Fields are
    declared in their wire order."""

    FRAME: ClassVar[FrameType] = FrameType.HANDOFF
    epoch: int = field(metadata=bounds(Int()))
    session_id: str = field(metadata=bounds(_SESSION, wire="session"))
    window_offset: int = field(metadata=bounds(Int()))
    chunk_size: int = field(metadata=bounds(Int(1, MAX_CHUNK)))
    train: tuple[int, int] = field(metadata=bounds(_RANGE))
    val: tuple[int, int] = field(metadata=bounds(_RANGE))
    resume_from: int = field(default=0, metadata=bounds(Int()))
    skip: int = field(default=0, metadata=bounds(Int()))
    length: int | None = field(default=None, metadata=bounds(Opt(Int())))  # default: the whole train + val
    conventional: bool = field(default=False, metadata=bounds(Flag(), wire="plain", sparse=True))
    #: to an attesting holder the key travels wrapped (``core.protocol.keywrap``), hex; ``key`` is then None
    wrapped_key: str | None = field(default=None, metadata=bounds(Opt(Hex(max_len=1024)), sparse=True))
    key_fp: str | None = field(default=None, metadata=bounds(Opt(Str(64)), sparse=True))  # the wrapped key's
    key: ProvisioningKey | None = field(default=None, metadata=bounds(Opt(KeySpec()), sparse=True))
    data_endpoint: DataEndpoint | None = field(default=None, metadata=bounds(Opt(Nested(DataEndpoint)),
                                                                                sparse=True))
    #: "SEQ:HASH" of the audit ledger at this hand-off, for the holder's witness
    ledger_head: str | None = field(default=None, metadata=bounds(Opt(Str(_TEXT)), sparse=True))
    #: the run this hand-off belongs to (wire name "run"): a holder's witness keeps its heads per run (issue 30)
    run_id: str | None = field(default=None, metadata=bounds(Opt(Str(128)), wire="run", sparse=True))
    #: this HANDOFF's own id (hex) when a copy of it is also relayed by the device on the agent's parked data
    #: connection (wire name "relay"): the agent takes the first copy to arrive and skips the other
    relay_id: str | None = field(default=None, metadata=bounds(Opt(Hex(max_len=32)), wire="relay", sparse=True))

    @classmethod
    def for_window(cls, *, epoch: int, session_id: str, key: ProvisioningKey, skip: int, length: int,
                   chunk_size: int, train: tuple[int, int], val: tuple[int, int], conventional: bool = False,
                   ledger_head: str | None = None) -> Handoff:
        """The hand-off of bytes [skip, skip+length) of a visit's window in ``epoch`` under ``key`` (the window
        starts where its key's bytes do: ``window_offset`` is ``skip``). The one builder for the device's grant
        (``open_window``) and for the key the orchestrator derives itself before the window opens, so the two
        cannot drift apart."""
        return cls(epoch=epoch, session_id=session_id, key=key, window_offset=skip, chunk_size=chunk_size,
                   train=train, val=val, skip=skip, length=length, conventional=conventional, ledger_head=ledger_head)

    @property
    def window_len(self) -> int:
        """Bytes under this key."""
        return self.length if self.length is not None else self.train[1] + self.val[1] - self.skip

    @property
    def n_chunks(self) -> int:
        return -(-self.window_len // self.chunk_size)

    def to_wire(self) -> dict[str, Any]:
        h = self.wire_fields()
        h["length"] = self.window_len
        if self.conventional:  # no GPU key leaves the orchestrator on the conventional path
            for name in ("wrapped_key", "key_fp", "key"):
                h.pop(name, None)
        elif self.wrapped_key is not None:
            h.pop("key", None)
        return h

    def validated(self) -> Handoff:
        """One form of the key at most (none on the conventional path), of this hand-off's epoch; then
        :meth:`check`."""
        if self.conventional and (self.key is not None or self.wrapped_key is not None):
            raise FrameError("HANDOFF carries a key on the conventional path")
        if self.key is not None and self.wrapped_key is not None:
            raise FrameError("HANDOFF carries its key both wrapped and bare")
        if not self.conventional and self.key is None and self.wrapped_key is None:
            raise WireFormatError("Handoff.key: missing", field="Handoff.key")
        if self.key is not None and self.key.epoch != self.epoch:
            raise FrameError(f"HANDOFF of epoch {self.epoch} carries a key of epoch {self.key.epoch}")
        self.check()
        return self

    def check(self) -> None:
        """The window lies inside the visit's slices and the resume point inside the window."""
        visit = self.train[1] + self.val[1]
        if self.window_len <= 0 or self.skip + self.window_len > visit:
            raise FrameError(f"HANDOFF window [{self.skip}, {self.skip + self.window_len}) is outside this "
                             f"visit's {visit} bytes")
        if self.resume_from > self.n_chunks:
            raise FrameError(f"HANDOFF resumes at chunk {self.resume_from} of {self.n_chunks}")

    def __repr__(self) -> str:  # never the key
        fp = self.key.fingerprint if self.key is not None else self.key_fp or "-"
        return f"Handoff(epoch={self.epoch}, window={self.window_offset}+{self.window_len}, key={fp})"


@dataclass(frozen=True, slots=True)
class _VisitRows(Spec):
    """BYE ``rows``: ``{"EPOCH": [[SEQ, "HASH"], ...]}``, each hash 64 lowercase hex digits, at most
    ``MAX_BYE_ROWS`` rows in all; held as ``{epoch: ((seq, hash), ...)}``."""

    def check(self, value: Any, where: str) -> dict[int, tuple[tuple[int, str], ...]]:
        if type(value) is not dict:
            raise WireFormatError(f"{where}: must be an object of epochs", field=where)
        out: dict[int, tuple[tuple[int, str], ...]] = {}
        count = 0
        for epoch_s, pairs in value.items():
            if not (isinstance(epoch_s, str) and epoch_s.isdigit() and 0 < len(epoch_s) <= 20) or \
                    type(pairs) is not list:
                raise WireFormatError(f"{where}: entry {str(epoch_s)[:24]!r} is not EPOCH: [[SEQ, HASH], ...]",
                                      field=where)
            rows = []
            for pair in pairs:
                if not (type(pair) is list and len(pair) == 2 and type(pair[0]) is int and pair[0] > 0
                        and isinstance(pair[1], str) and len(pair[1]) == 64
                        and all(c in "0123456789abcdef" for c in pair[1])):
                    raise WireFormatError(f"{where}: of epoch {epoch_s}: a row is [SEQ, 64-hex HASH]", field=where)
                rows.append((pair[0], pair[1]))
            count += len(rows)
            if count > MAX_BYE_ROWS:
                raise WireFormatError(f"{where}: holds more than {MAX_BYE_ROWS} rows", field=where)
            out[int(epoch_s)] = tuple(rows)
        return out

    def dump(self, value: Any) -> Any:
        return {str(epoch): [[seq, digest] for seq, digest in pairs] for epoch, pairs in value.items()}


@dataclass(frozen=True, slots=True)
class Bye(FrameMessage):
    """The run lets the agent go; ``ledger_head`` (``SEQ:HASH``) is the ledger after every visit; ``rows``:
    for each epoch of this holder's visits, the ledger rows the run wrote for it (``(seq, hash)``), returned
    after the visits so the holder's receipts name each row (issue 30)."""

    FRAME: ClassVar[FrameType] = FrameType.BYE
    ledger_head: str | None = field(default=None, metadata=bounds(Opt(Str(_TEXT)), sparse=True))
    run_id: str | None = field(default=None, metadata=bounds(Opt(Str(128)), wire="run", sparse=True))
    rows: Mapping[int, tuple[tuple[int, str], ...]] = field(default_factory=dict,
                                                            metadata=bounds(_VisitRows(), sparse=True))


# --- data connection: agent <-> device ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DataOpen(FrameMessage):
    """DATA_OPEN: the first frame of a data connection (``session``; ``rings``: the agent can map
    shared-memory rings), or, on an open connection, a request to bind a ring of shape ``ring`` to a
    hand-off's epoch. ``admit`` (the first DATA_OPEN's): who speaks, for which window (``Admission``)."""

    FRAME: ClassVar[FrameType] = FrameType.DATA_OPEN
    session_id: str = field(metadata=bounds(_SESSION, wire="session"))
    rings: bool = field(default=False, metadata=bounds(Flag(as_int=True), sparse=True))
    ring: RingSpec | None = field(default=None, metadata=bounds(Opt(Nested(RingSpec)), sparse=True))
    admit: Admission | None = field(default=None, metadata=bounds(Opt(Nested(Admission)), sparse=True))


@dataclass(frozen=True, slots=True)
class DataReady(FrameMessage):
    """DATA_READY: the device accepts the connection (``rings``: it offers rings on it), or has bound the
    ring ``ring`` (``mapped``: the one this connection already maps; otherwise its descriptor came along)."""

    FRAME: ClassVar[FrameType] = FrameType.DATA_READY
    session_id: str = field(metadata=bounds(_SESSION, wire="session"))
    rings: bool = field(default=False, metadata=bounds(Flag(as_int=True), sparse=True))
    ring: RingSpec | None = field(default=None, metadata=bounds(Opt(Nested(RingSpec)), sparse=True))
    mapped: bool = field(default=False, metadata=bounds(Flag(as_int=True), sparse=True))
