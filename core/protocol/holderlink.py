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

Each message has ``to_wire()`` (its frame header) and a validating ``from_wire(header)`` that raises
``FrameError`` (code ``frame``) for a missing field, a wrong type or a number out of range: nothing
reads a peer's header by hand, and a malformed one is charged to whoever sent it. Unknown keys are
ignored, so a field added later (a data connection's admission credential, say) is one line here and
old peers keep working. The headers themselves were decoded with ``wirejson``'s size and depth limits.

``ProvisioningKey`` is the one typed form of a hand-off's key (a ``DirectionKey`` whose ``repr`` shows
its fingerprint, never its bytes): derived by the device (``BufferWindows.op_handoff``), sent to the
orchestrator inside the sealed control channel (``HandoffGrant``), carried in the orchestrator's
``Handoff`` and forwarded to the agent inside the holder link, where ``SendState`` seals with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gputravel.core.protocol.admission import Admission
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.frames import FrameType
from gputravel.core.protocol.holderattest import Attest, Verdict
from gputravel.core.protocol.holderfields import (
    _MISSING,
    POLICY_SOURCES,
    _flag,
    _get,
    _hex,
    _int,
    _source,
    _str,
)
from gputravel.core.protocol.keys import KEY_LEN, PREFIX_LEN, DirectionKey
from gputravel.core.protocol.shmring import RingSpec

__all__ = ["MAX_BYE_ROWS", "MAX_CHUNK", "Admission", "Attest", "Bye", "DataEndpoint", "DataOpen", "DataReady", "Done", "Handoff",
           "Hello", "POLICY_SOURCES", "Progress", "ProvisioningKey", "Refusal", "TOKEN_FORMATS", "Verdict"]

#: The largest chunk a hand-off may ask for (the device's limit too).
MAX_CHUNK = 16 * 1024 * 1024
#: Token formats a holder's dataset may have: byte tokens (.txt) or llm.c's uint16 or uint32 shards (.bin).
TOKEN_FORMATS = ("byte", "u16", "u32")


def _range(h: Mapping[str, Any], what: str, name: str) -> tuple[int, int]:
    value = _get(h, what, name, _MISSING)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise FrameError(f"{what} {name!r} must be [start, length]")
    pair = {"start": value[0], "length": value[1]}
    return _int(pair, f"{what} {name}", "start"), _int(pair, f"{what} {name}", "length")


def _ring(h: Mapping[str, Any], what: str) -> RingSpec | None:
    value = h.get("ring")
    if value is None:
        return None
    try:
        return RingSpec.from_wire(value)
    except FrameError as exc:
        raise FrameError(f"{what} ring: {exc.reason}") from None


# --- the key -------------------------------------------------------------------------------------
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
        return {"key": self.key.hex(), "prefix": self.prefix.hex(), "epoch": int(self.epoch),
                "direction": int(self.direction)}

    @classmethod
    def from_wire(cls, data: Any) -> ProvisioningKey:
        """Validate a key's wire form (``DirectionKey.to_wire``): 32 hex key bytes, a 4-byte hex prefix,
        the epoch, and the holder -> device direction; anything else is ``FrameError``."""
        what = "provisioning key"
        if not isinstance(data, Mapping):
            raise FrameError(f"{what} is not an object")
        key = bytes.fromhex(_hex(data, what, "key", nbytes=KEY_LEN))
        prefix = bytes.fromhex(_hex(data, what, "prefix", nbytes=PREFIX_LEN))
        direction = _int(data, what, "direction", hi=255)
        if direction != Direction.HOLDER_TO_DEVICE:
            raise FrameError(f"{what} is for direction {direction}, not holder -> device")
        return cls(key, prefix, _int(data, what, "epoch"), direction)


# --- holder link: agent -> orchestrator --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """The agent's first frame: who it is and what it holds (sizes only, never data)."""

    FRAME: ClassVar[FrameType] = FrameType.HELLO
    name: str
    version: str
    fmt: str  # "byte", "u16" or "u32" (wire name "format")
    train_bytes: int
    val_bytes: int
    files: int
    agent_sha256: str
    pid: int | None = None
    #: an attesting agent: its first nonce (hex, 32 bytes) and its X25519 key-exchange key (hex, 32 bytes)
    nonce: str | None = None
    link_pub: str | None = None
    #: an attesting agent: the SHA-256 of what it checks (``agents.holder.config.policy_summary``), and whose policy
    #: it is: "holder" (``gputravel holder serve``: the holder's own configuration) or "orchestrator" (issue 30)
    policy_sha256: str | None = None
    policy_source: str | None = None

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"name": self.name, "version": self.version, "format": self.fmt,
                             "train_bytes": self.train_bytes, "val_bytes": self.val_bytes, "files": self.files,
                             "agent_sha256": self.agent_sha256}
        if self.pid is not None:
            h["pid"] = self.pid
        if self.nonce is not None and self.link_pub is not None:
            h["nonce"], h["link_pub"] = self.nonce, self.link_pub
        if self.policy_sha256 is not None:
            h["policy_sha256"], h["policy_source"] = self.policy_sha256, self.policy_source
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Hello:
        w = "HELLO"
        fmt = _str(h, w, "format")
        if fmt not in TOKEN_FORMATS:
            raise FrameError(f"{w} names unknown token format {fmt!r}")
        return cls(name=_str(h, w, "name", default=""), version=_str(h, w, "version", default=""), fmt=fmt,
                   train_bytes=_int(h, w, "train_bytes"), val_bytes=_int(h, w, "val_bytes"),
                   files=_int(h, w, "files", hi=1 << 31), agent_sha256=_hex(h, w, "agent_sha256", nbytes=32),
                   pid=_int(h, w, "pid", hi=1 << 31, default=None),
                   nonce=_hex(h, w, "nonce", nbytes=32, default=None),
                   link_pub=_hex(h, w, "link_pub", nbytes=32, default=None),
                   policy_sha256=_hex(h, w, "policy_sha256", nbytes=32, default=None),
                   policy_source=_source(h, w))


@dataclass(frozen=True, slots=True)
class Progress:
    """Direct path: ``chunks`` more chunks acknowledged by the device, the last of them ``seq``."""

    FRAME: ClassVar[FrameType] = FrameType.ACK
    seq: int
    chunks: int = 1

    def to_wire(self) -> dict[str, Any]:
        return {"s": self.seq, "n": self.chunks}

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Progress:
        return cls(seq=_int(h, "ACK", "s"), chunks=_int(h, "ACK", "n", lo=1, hi=1 << 32, default=1))


@dataclass(frozen=True, slots=True)
class Refusal:
    """An ERROR: a refused chunk (``seq`` set), a refused ring bind (``ring``), or the whole hand-off."""

    FRAME: ClassVar[FrameType] = FrameType.ERROR
    code: str
    reason: str
    seq: int | None = None
    ring: bool = False

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"code": self.code, "reason": self.reason}
        if self.seq is not None:
            h["s"] = self.seq
        if self.ring:
            h["ring"] = 1
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Refusal:
        w = "ERROR"
        return cls(code=_str(h, w, "code", default="error", max_len=64), reason=_str(h, w, "reason", default=""),
                   seq=_int(h, w, "s", default=None), ring=_flag(h, w, "ring"))


@dataclass(frozen=True, slots=True)
class Done:
    """The agent sent its window: chunks sent under this key, bytes, retransmissions, and its own
    seconds per stage (``read_seal_s``, ``wait_s``, ``setup_s``, ``data_s``)."""

    FRAME: ClassVar[FrameType] = FrameType.DONE
    epoch: int
    chunks: int
    nbytes: int  # wire name "bytes"
    retransmits: int = 0
    stages: Mapping[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "chunks": self.chunks, "bytes": self.nbytes, "retransmits": self.retransmits,
                "stages": dict(self.stages)}

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Done:
        w = "DONE"
        raw = _get(h, w, "stages", {})
        if not isinstance(raw, Mapping) or len(raw) > 64:
            raise FrameError(f"{w} stages must be an object of at most 64 numbers")
        stages: dict[str, float] = {}
        for k, v in raw.items():
            if type(v) not in (int, float) or not math.isfinite(v) or len(k) > 64:
                raise FrameError(f"{w} stage {k[:64]!r} is not a finite number")
            stages[k] = float(v)
        return cls(epoch=_int(h, w, "epoch"), chunks=_int(h, w, "chunks"), nbytes=_int(h, w, "bytes"),
                   retransmits=_int(h, w, "retransmits", default=0), stages=stages)


# --- holder link: orchestrator -> agent --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DataEndpoint:
    """Where the agent sends sealed chunks on the direct path: the device's Unix socket (``path``, same
    host) or its TCP data port (``host``, ``port``). ``ring``: the agent may ask for a shared-memory ring
    (only on the Unix socket; ``bench provision``'s ``direct-socket`` path turns it off)."""

    path: str | None = None
    host: str | None = None
    port: int | None = None
    ring: bool = True

    def __post_init__(self) -> None:
        if (self.path is None) == (self.host is None or self.port is None):
            raise FrameError("a data endpoint is a socket path or a host and port")

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"path": self.path} if self.path is not None else {"host": self.host, "port": self.port}
        if not self.ring:
            h["ring"] = False
        return h

    @classmethod
    def from_wire(cls, h: Any) -> DataEndpoint:
        w = "data endpoint"
        if not isinstance(h, Mapping):
            raise FrameError(f"{w} is not an object")
        ring = _flag({"ring": h.get("ring", True)}, w, "ring")
        if h.get("path") is not None:
            return cls(path=_str(h, w, "path"), ring=ring)
        return cls(host=_str(h, w, "host", max_len=255), port=_int(h, w, "port", lo=1, hi=65535), ring=ring)


@dataclass(frozen=True, slots=True)
class Handoff:
    """One window of one visit for one holder: what the orchestrator sends in HANDOFF.

    ``key`` travels only inside the holder link, and not at all on the conventional path (``conventional``:
    the holder sends plaintext over its link and the orchestrator seals it under ``key`` itself). ``skip``
    and ``length`` say which bytes of the visit's window (its train slice, then its val slice) this key
    covers; ``resume_from`` is the first chunk still to send. ``repr`` never shows the key."""

    FRAME: ClassVar[FrameType] = FrameType.HANDOFF
    epoch: int
    session_id: str  # hex (wire name "session")
    key: ProvisioningKey | None
    window_offset: int
    chunk_size: int
    train: tuple[int, int]
    val: tuple[int, int]
    resume_from: int = 0
    skip: int = 0
    length: int | None = None  # default: the whole train + val window
    conventional: bool = False  # wire name "plain"
    ledger_head: str | None = None  # "SEQ:HASH" of the audit ledger at this hand-off, for the holder's witness
    data_endpoint: DataEndpoint | None = None
    #: to an attesting holder the key travels wrapped (``core.protocol.keywrap``), hex; ``key`` is then None
    wrapped_key: str | None = None
    key_fp: str | None = None  # the wrapped key's fingerprint (the one the holder's verdict was for)
    #: the run this hand-off belongs to (wire name "run"): a holder's witness keeps its heads per run (issue 30)
    run_id: str | None = None

    @property
    def window_len(self) -> int:
        """Bytes under this key."""
        return self.length if self.length is not None else self.train[1] + self.val[1] - self.skip

    @property
    def n_chunks(self) -> int:
        return -(-self.window_len // self.chunk_size)

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"epoch": self.epoch, "session": self.session_id, "window_offset": self.window_offset,
                             "chunk_size": self.chunk_size, "train": list(self.train), "val": list(self.val),
                             "resume_from": self.resume_from, "skip": self.skip, "length": self.window_len}
        if self.conventional:
            h["plain"] = True  # no GPU key leaves the orchestrator on the conventional path
        elif self.wrapped_key is not None:
            h["wrapped_key"], h["key_fp"] = self.wrapped_key, self.key_fp
        elif self.key is not None:
            h["key"] = self.key.to_wire()
        if self.data_endpoint is not None:
            h["data_endpoint"] = self.data_endpoint.to_wire()
        if self.ledger_head is not None:
            h["ledger_head"] = self.ledger_head
        if self.run_id is not None:
            h["run"] = self.run_id
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Handoff:
        w = "HANDOFF"
        conventional = _flag(h, w, "plain")
        if conventional and h.get("key") is not None:
            raise FrameError(f"{w} carries a key on the conventional path")
        wrapped = None if conventional else _hex(h, w, "wrapped_key", default=None)
        key_fp = _str(h, w, "key_fp", default=None, max_len=64) if wrapped is not None else None
        key = None if conventional or wrapped is not None else ProvisioningKey.from_wire(_get(h, w, "key", _MISSING))
        epoch = _int(h, w, "epoch")
        if key is not None and key.epoch != epoch:
            raise FrameError(f"{w} of epoch {epoch} carries a key of epoch {key.epoch}")
        endpoint = h.get("data_endpoint")
        handoff = cls(epoch=epoch, session_id=_hex(h, w, "session"), key=key,
                      window_offset=_int(h, w, "window_offset"), chunk_size=_int(h, w, "chunk_size", lo=1,
                                                                                 hi=MAX_CHUNK),
                      train=_range(h, w, "train"), val=_range(h, w, "val"), resume_from=_int(h, w, "resume_from",
                                                                                             default=0),
                      skip=_int(h, w, "skip", default=0), length=_int(h, w, "length", default=None),
                      conventional=conventional, ledger_head=_str(h, w, "ledger_head", default=None),
                      data_endpoint=None if endpoint is None else DataEndpoint.from_wire(endpoint),
                      wrapped_key=wrapped, key_fp=key_fp, run_id=_str(h, w, "run", default=None, max_len=128))
        handoff.check()
        return handoff

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


#: the most ledger rows a BYE may return to one holder (its visits' rows; the header's 1 MiB bounds it too)
MAX_BYE_ROWS = 8192


def _visit_rows(h: Mapping[str, Any]) -> dict[int, tuple[tuple[int, str], ...]]:
    """BYE ``rows``: ``{"EPOCH": [[SEQ, "HASH"], ...]}``, each hash 64 lowercase hex digits."""
    raw = h.get("rows")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise FrameError("BYE 'rows' must be an object of epochs")
    out: dict[int, tuple[tuple[int, str], ...]] = {}
    count = 0
    for epoch_s, pairs in raw.items():
        if not (isinstance(epoch_s, str) and epoch_s.isdigit() and 0 < len(epoch_s) <= 20) or \
                not isinstance(pairs, list):
            raise FrameError(f"BYE 'rows' entry {str(epoch_s)[:24]!r} is not EPOCH: [[SEQ, HASH], ...]")
        rows = []
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and pair[0] > 0
                    and isinstance(pair[1], str) and len(pair[1]) == 64
                    and all(c in "0123456789abcdef" for c in pair[1])):
                raise FrameError(f"BYE 'rows' of epoch {epoch_s}: a row is [SEQ, 64-hex HASH]")
            rows.append((pair[0], pair[1]))
        count += len(rows)
        if count > MAX_BYE_ROWS:
            raise FrameError(f"BYE 'rows' holds more than {MAX_BYE_ROWS} rows")
        out[int(epoch_s)] = tuple(rows)
    return out


@dataclass(frozen=True, slots=True)
class Bye:
    """The run lets the agent go; ``ledger_head`` (``SEQ:HASH``) is the ledger after every visit; ``rows``:
    for each epoch of this holder's visits, the ledger rows the run wrote for it (``(seq, hash)``), returned
    after the visits so the holder's receipts name each row (issue 30)."""

    FRAME: ClassVar[FrameType] = FrameType.BYE
    ledger_head: str | None = None
    run_id: str | None = None  # wire name "run"
    rows: Mapping[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {} if self.ledger_head is None else {"ledger_head": self.ledger_head}
        if self.run_id is not None:
            h["run"] = self.run_id
        if self.rows:
            h["rows"] = {str(epoch): [[seq, digest] for seq, digest in pairs] for epoch, pairs in self.rows.items()}
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Bye:
        return cls(ledger_head=_str(h, "BYE", "ledger_head", default=None),
                   run_id=_str(h, "BYE", "run", default=None, max_len=128), rows=_visit_rows(h))


# --- data connection: agent <-> device ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DataOpen:
    """DATA_OPEN: the first frame of a data connection (``session``; ``rings``: the agent can map
    shared-memory rings), or, on an open connection, a request to bind a ring of shape ``ring`` to a
    hand-off's epoch. ``admit`` (the first DATA_OPEN's): who speaks, for which window (``Admission``)."""

    FRAME: ClassVar[FrameType] = FrameType.DATA_OPEN
    session_id: str  # hex (wire name "session")
    rings: bool = False
    ring: RingSpec | None = None
    admit: Admission | None = None

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"session": self.session_id}
        if self.rings:
            h["rings"] = 1
        if self.ring is not None:
            h["ring"] = self.ring.to_wire()
        if self.admit is not None:
            h["admit"] = self.admit.to_wire()
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> DataOpen:
        w = "DATA_OPEN"
        admit = h.get("admit") if isinstance(h, Mapping) else None
        return cls(session_id=_hex(h, w, "session"), rings=_flag(h, w, "rings"), ring=_ring(h, w),
                   admit=None if admit is None else Admission.from_wire(admit))


@dataclass(frozen=True, slots=True)
class DataReady:
    """DATA_READY: the device accepts the connection (``rings``: it offers rings on it), or has bound the
    ring ``ring`` (``mapped``: the one this connection already maps; otherwise its descriptor came along)."""

    FRAME: ClassVar[FrameType] = FrameType.DATA_READY
    session_id: str
    rings: bool = False
    ring: RingSpec | None = None
    mapped: bool = False

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"session": self.session_id}
        if self.rings:
            h["rings"] = 1
        if self.ring is not None:
            h["ring"] = self.ring.to_wire()
        if self.mapped:
            h["mapped"] = 1
        return h

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> DataReady:
        w = "DATA_READY"
        return cls(session_id=_hex(h, w, "session"), rings=_flag(h, w, "rings"), ring=_ring(h, w),
                   mapped=_flag(h, w, "mapped"))
