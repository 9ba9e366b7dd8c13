"""The device link: what both ends of the orchestrator <-> device connection share.

Part of the wire protocol (standard library and ``cryptography`` only): the device service
(``core/device/server.py``, ``service.py``) and the orchestrator's client (``core/deviceclient/``) both speak
it, and neither side's code is needed to read it. It holds:

* ``send_frame``: one frame onto a socket (large payloads without a copy into the head);
* ``session_context``: what the authenticated key exchange binds (the verifier's nonce and the exact
  evidence it checked);
* ``ControlChannel``: one side's sealed request/response state for one control epoch;
* ``Op``: every operation a sealed request may name, the one vocabulary of the device's operation
  table (``DeviceService.operations``) and the client's typed methods;
* ``MAC_KEY_BYTES``: the length of the key the orchestrator sends with ``measure`` for the model's MAC.

The typed answers to those operations are ``core.protocol.deviceanswers``.

Wire format of a control exchange: the request is one ``SEALED`` frame whose plaintext is a
``REQUEST`` frame ``{"op": OP, "args": {...}}`` plus a payload; the answer is one ``SEALED`` frame
holding a ``RESPONSE`` frame ``{"ok": true, ...}`` (or ``{"ok": false, "code", "reason"}``) plus a
payload. Each sealed frame takes the next sequence number of its direction.

Model state moves as a stream of bounded chunks already sealed under a checkpoint key
(``core.protocol.stream``): one chunk per request or answer (``checkpoint_next``, ``restore_chunk``), each
*attached* to its sealed frame rather than encrypted again: the sealed inner header binds the chunk's length
and GCM tag, the outer header's ``a`` says how many bytes follow the ciphertext (``send_sealed``,
``ControlChannel.seal(..., attached=True)``). No frame exceeds ``MAX_PAYLOAD``.
"""

from __future__ import annotations

import socket
from enum import StrEnum
from typing import Any, Protocol

from gputravel.core.protocol.cipher import TAG_LEN, Direction, RecvState, SendState
from gputravel.core.protocol.errors import FrameError, GpuTravelError, TagError
from gputravel.core.protocol.frames import (
    MAX_PAYLOAD,
    Frame,
    FrameType,
    decode_frame,
    encode_frame,
    frame_head,
)
from gputravel.core.protocol.keys import DirectionKey, channel_key

__all__ = ["ATTACHED", "MAC_KEY_BYTES", "MAX_SEALED_PAYLOAD", "ControlChannel", "Op", "SessionKeys", "error_header",
           "send_frame", "send_sealed", "session_context"]

#: inner-header key binding a sealed frame's attached bytes: ``[length, hex GCM tag]``
ATTACHED = "_attached"

#: The largest payload one sealed control frame may carry (its tag and inner frame head fit in the rest).
MAX_SEALED_PAYLOAD = MAX_PAYLOAD - TAG_LEN - 1024

#: The model MAC's key (``measure``'s payload; the device computes AES-GMAC under it: core/device/modelmac.py).
MAC_KEY_BYTES = 32


class Op(StrEnum):
    """The device's operations, by their wire names."""

    ATTEST = "attest"
    ROTATE = "rotate"
    SHUTDOWN = "shutdown"
    INFO = "info"
    CONFIGURE = "configure"
    MEASURE = "measure"
    HANDOFF = "handoff"
    CLOSE_WINDOW = "close_window"
    WINDOW_STATUS = "window_status"
    TRAIN = "train"
    SCRUB = "scrub"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_NEXT = "checkpoint_next"
    CHECKPOINT_END = "checkpoint_end"
    RESTORE = "restore"
    RESTORE_CHUNK = "restore_chunk"
    RESTORE_END = "restore_end"
    STATS = "stats"
    AES_RATE = "aes_rate"
    TAMPER = "tamper"
    DIGEST = "digest"
    SET_DATA_PATH = "set_data_path"
    RELAY = "relay"  # a HANDOFF wrapped for its holder, written by the device on that holder's parked data connection
    GPU_EVIDENCE = "gpu_evidence"  # SPDM GET_MEASUREMENTS in NVIDIA's format over a caller's nonce (core/device/spdm.py)


class SessionKeys(Protocol):
    """What a control channel is keyed from: the session's master secret and id (``core.handshake.SessionSecrets``,
    the authenticated key exchange's result)."""

    @property
    def master(self) -> bytes: ...

    @property
    def session_id(self) -> bytes: ...


def send_frame(sock: socket.socket, ftype: FrameType, header: dict[str, Any] | None = None,
               payload: bytes | bytearray | memoryview = b"") -> None:
    head = frame_head(ftype, header, len(payload))
    if len(payload) <= 65536:
        sock.sendall(head + bytes(payload))
    else:
        sock.sendall(head)
        sock.sendall(payload)


def send_sealed(sock: socket.socket, header: dict[str, Any], ct: bytes,
                attached: bytes | bytearray | memoryview = b"") -> None:
    """One ``SEALED`` frame: the ciphertext, then any attached pre-sealed bytes (sent without a copy)."""
    head = frame_head(FrameType.SEALED, header, len(ct) + len(attached))
    if len(ct) + len(attached) <= 65536:
        sock.sendall(b"".join((head, ct, attached)))
        return
    sock.sendall(head + ct)
    if len(attached):
        sock.sendall(attached)


def session_context(nonce: bytes, evidence_digest: bytes) -> bytes:
    """What the key exchange binds: the verifier's nonce and the digest of the exact evidence it checked."""
    return b"gputravel-ctx-v1" + nonce + bytes(evidence_digest)


def error_header(exc: BaseException) -> dict[str, Any]:
    """A refusal as the device sends it: the typed error's code and reason (anything else is ``device``)."""
    if isinstance(exc, GpuTravelError):
        return {"ok": False, "code": exc.code, "reason": exc.reason}
    return {"ok": False, "code": "device", "reason": f"{type(exc).__name__}: {exc}"}


class ControlChannel:
    """Sealed request/response state of one side of the control channel in one epoch."""

    def __init__(self, send_key: DirectionKey, recv_key: DirectionKey, session_id: bytes) -> None:
        self.send = SendState(send_key, session_id=session_id)
        self.recv = RecvState(recv_key, session_id=session_id, window=1)
        self.epoch = send_key.epoch

    @classmethod
    def for_orchestrator(cls, secrets: SessionKeys, epoch: int) -> ControlChannel:
        """The orchestrator's side: sends orchestrator -> device, opens device -> orchestrator."""
        return cls(channel_key(secrets.master, secrets.session_id, epoch=epoch, direction=Direction.ORCH_TO_DEVICE),
                   channel_key(secrets.master, secrets.session_id, epoch=epoch, direction=Direction.DEVICE_TO_ORCH),
                   secrets.session_id)

    @classmethod
    def for_device(cls, secrets: SessionKeys, epoch: int) -> ControlChannel:
        """The device's side: the same two keys, the other way round."""
        return cls(channel_key(secrets.master, secrets.session_id, epoch=epoch, direction=Direction.DEVICE_TO_ORCH),
                   channel_key(secrets.master, secrets.session_id, epoch=epoch, direction=Direction.ORCH_TO_DEVICE),
                   secrets.session_id)

    def seal(self, ftype: FrameType, header: dict[str, Any],
             payload: bytes | bytearray | memoryview, *, attached: bool = False) -> tuple[dict[str, Any], bytes]:
        """(outer header, ciphertext) of one sealed frame holding ``ftype`` with ``header`` and ``payload``.

        ``attached``: ``payload`` is already AES-GCM sealed under a key of its own (a checkpoint stream's chunk).
        It is then not encrypted again: the sealed frame holds only the header, which binds the attached
        bytes' length and GCM tag, and the sender appends the bytes after the ciphertext (``send_sealed``).
        The receiver's :meth:`open` checks the binding. The outer header's ``a`` says how many bytes follow."""
        if attached:
            view = memoryview(payload)
            if len(view) < TAG_LEN:
                raise FrameError("attached bytes must be a sealed message (at least a tag)")
            bound = {**header, ATTACHED: [len(view), bytes(view[-TAG_LEN:]).hex()]}
            seq, ct = self.send.seal(encode_frame(ftype, bound, b""), frame_type=FrameType.SEALED)
            return {"e": self.epoch, "s": seq, "a": len(view)}, ct
        inner = encode_frame(ftype, header, payload)
        seq, ct = self.send.seal(inner, frame_type=FrameType.SEALED)
        return {"e": self.epoch, "s": seq}, ct

    def open(self, header: dict[str, Any], payload: bytes | bytearray | memoryview) -> Frame:
        """Authenticate and decrypt one sealed frame; returns the inner frame (with attached bytes, if any, as
        its payload, after checking they are the ones the sealed header names)."""
        try:
            epoch, seq = int(header["e"]), int(header["s"])
            n_att = header.get("a")
            if n_att is not None and (type(n_att) is not int or not TAG_LEN <= n_att <= len(payload)):
                raise ValueError(n_att)
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: JSON Infinity
            raise FrameError("sealed frame header needs integer e and s (and a valid a)") from None
        view = memoryview(payload)
        ct, att = (view, None) if n_att is None else (view[: len(view) - n_att], view[len(view) - n_att:])
        inner = decode_frame(self.recv.open(ct, seq=seq, epoch=epoch, frame_type=FrameType.SEALED))
        bound = inner.header.pop(ATTACHED, None)
        if att is None:
            if bound is not None:
                raise TagError("a sealed frame names attached bytes that did not come with it")
            return inner
        if bound != [n_att, bytes(att[-TAG_LEN:]).hex()] or len(inner.payload):
            raise TagError("the attached bytes are not the ones the sealed frame names")
        return Frame(inner.type, inner.header, att)
