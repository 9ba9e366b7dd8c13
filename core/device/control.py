"""The device's control session (the command loop): one at a time, over the Unix socket.

Attestation (evidence over the verifier's nonce), the authenticated key exchange that opens a session, then
sealed requests, each dispatched by name through the service's one operation table
(:meth:`~gputravel.core.device.service.DeviceService.handle`) and answered sealed; a ROTATE answer moves the
channel to its new epoch's keys. A bad request is answered with a typed error, never ends the device. The
channel's state (its keys and epoch) lives in this function's frame: one session, one loop.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from gputravel.core.device.pending import Pending
from gputravel.core.device.reply import Reply
from gputravel.core.device.service import DeviceService
from gputravel.core.protocol import Frame, FrameError, FrameType, read_frame
from gputravel.core.protocol.devicelink import (
    ControlChannel,
    error_header,
    send_frame,
    send_sealed,
    session_context,
)

__all__ = ["serve_control"]


def serve_control(svc: DeviceService, conn: socket.socket, stream: Any, first: Frame, pending: Pending, *,
              on_stop: Callable[[], None]) -> None:
    """The control session: evidence over the verifier's nonce, the authenticated key exchange, then one
    sealed request after another, each dispatched through the service's operation table and answered sealed,
    until the peer leaves or a SHUTDOWN answer asks to stop (``on_stop``: the server closes)."""
    nonce = bytes.fromhex(str(first.header.get("nonce", "")))
    evidence = svc.evidence(nonce)
    send_frame(conn, FrameType.EVIDENCE, {"evidence": evidence.to_dict()})
    kex = read_frame(stream)
    if kex is None or kex.type is not FrameType.KEX_INIT:
        raise FrameError("expected KEX_INIT")
    pub, sig, secrets = svc.open_session(initiator_public=bytes.fromhex(kex.header["public"]),
                                         context=session_context(nonce, evidence.digest()))
    send_frame(conn, FrameType.KEX_REPLY, {"public": pub.hex(), "signature": sig.hex()})
    pending.authenticated()  # the session is open: no hand-shake time limit from here on
    chan = ControlChannel.for_device(secrets, 0)
    while True:
        frame = read_frame(stream)
        if frame is None:
            return
        if frame.type is not FrameType.SEALED:
            raise FrameError(f"expected SEALED, got {frame.type.name}")
        inner = chan.open(frame.header, frame.payload)
        reply: Reply | None = None
        try:
            reply = svc.handle(str(inner.header.get("op", "")), dict(inner.header.get("args", {})),
                               bytes(inner.payload))
            head, ct = chan.seal(FrameType.RESPONSE, {"ok": True, **reply.header}, reply.payload,
                                 attached=reply.attached)
        except Exception as exc:  # the device reports, never dies, on a bad request (error_header types it)
            reply = None
            head, ct = chan.seal(FrameType.RESPONSE, error_header(exc), b"")
        send_sealed(conn, head, ct, reply.payload if reply is not None and reply.attached else b"")
        if reply is not None and reply.after is not None:
            reply.after()
        if reply is not None and reply.rekey_to is not None:
            chan = ControlChannel.for_device(secrets, reply.rekey_to)
        if reply is not None and reply.stop:
            on_stop()
            return
