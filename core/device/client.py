"""The orchestrator's side of the device link: attest, open a session, send sealed requests."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from cryptography import x509

from gputravel.core.attestation import AttestationResult, Evidence, Policy, code_measurement, verify_evidence
from gputravel.core.device.server import ControlChannel, send_frame, session_context
from gputravel.core.errors import DeviceError, FrameError, error_from_code
from gputravel.core.handshake import Initiator, SessionSecrets
from gputravel.core.protocol import Direction, FrameType, channel_key, read_frame


@dataclass(frozen=True, slots=True)
class TrustAnchors:
    """What the orchestrator pins: the vendor root, the revocation list, the policy."""

    root: x509.Certificate
    crl: x509.CertificateRevocationList | None
    policy: Policy


class DeviceClient:
    """A blocking client; the engine calls it from a worker thread (``asyncio.to_thread``)."""

    def __init__(self, socket_path: str, *, anchors: TrustAnchors, timeout: float = 600.0) -> None:
        self.socket_path = socket_path
        self.anchors = anchors
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stream: Any = None
        self._chan: ControlChannel | None = None
        self.secrets: SessionSecrets | None = None
        self.attestation: AttestationResult | None = None
        #: messages per control-channel key before an automatic rotation (low in tests)
        self.nonce_budget = 2**32
        self.rotations = 0
        self._expected_code: str | None = None  # policy code "auto", resolved on the first attestation

    # --- connection and attestation ----------------------------------------------------------
    def connect(self) -> AttestationResult:
        """Attest the device (fail closed), then open the authenticated session."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except OSError as exc:
            raise DeviceError(f"cannot reach the device service at {self.socket_path}: {exc}") from None
        self._sock, self._stream = sock, sock.makefile("rb", buffering=1 << 20)
        nonce = os.urandom(32)
        send_frame(sock, FrameType.ATTEST_REQUEST, {"nonce": nonce.hex()})
        frame = self._read()
        if frame.type is not FrameType.EVIDENCE:
            raise DeviceError(f"device answered {frame.type.name} to an attestation request: {frame.header}")
        evidence = Evidence.from_dict(frame.header["evidence"])
        result = self._verify(evidence, nonce)
        initiator = Initiator(context=session_context(nonce, evidence))
        send_frame(sock, FrameType.KEX_INIT, {"public": initiator.public_bytes().hex()})
        reply = self._read()
        if reply.type is not FrameType.KEX_REPLY:
            raise DeviceError(f"device answered {reply.type.name} to the key exchange")
        assert result.device_public_key is not None
        self.secrets = initiator.finish(device_public=bytes.fromhex(reply.header["public"]),
                                        signature=bytes.fromhex(reply.header["signature"]),
                                        device_key=result.device_public_key)
        self._set_epoch(0)
        self.attestation = result
        return result

    def _verify(self, evidence: Evidence, nonce: bytes) -> AttestationResult:
        if self._expected_code is None and self.anchors.policy.code == "auto":
            # the reference for "auto": this installation's device code, hashed once per client rather than
            # at every visit's attestation
            self._expected_code = code_measurement()
        result = verify_evidence(evidence, nonce=nonce, root=self.anchors.root, crl=self.anchors.crl,
                                 policy=self.anchors.policy, expected_code=self._expected_code)
        result.raise_for_failure()
        return result

    def attest(self) -> AttestationResult:
        """A fresh attestation inside the session (each visit starts with one)."""
        nonce = os.urandom(32)
        head, _ = self.call("attest", nonce=nonce.hex())
        result = self._verify(Evidence.from_dict(head["evidence"]), nonce)
        if self.attestation is not None and result.device_id != self.attestation.device_id:
            raise DeviceError("a different device answered inside the session")
        return result

    def _set_epoch(self, epoch: int) -> None:
        s = self.secrets
        assert s is not None
        send_key = channel_key(s.master, s.session_id, epoch=epoch, direction=Direction.ORCH_TO_DEVICE)
        recv_key = channel_key(s.master, s.session_id, epoch=epoch, direction=Direction.DEVICE_TO_ORCH)
        self._chan = ControlChannel(send_key, recv_key, s.session_id)

    @property
    def channel_epoch(self) -> int:
        return self._chan.epoch if self._chan else -1

    @property
    def session_id(self) -> bytes:
        assert self.secrets is not None
        return bytes(self.secrets.session_id)

    def _read(self) -> Any:
        try:
            frame = read_frame(self._stream)
        except (OSError, TimeoutError) as exc:
            raise DeviceError(f"device link failed: {exc}") from None
        if frame is None:
            raise DeviceError("the device service closed the connection")
        if frame.type is FrameType.ERROR:
            raise error_from_code(str(frame.header.get("code")), str(frame.header.get("reason")))
        return frame

    # --- sealed requests ------------------------------------------------------------------------
    def call(self, op: str, payload: bytes = b"", **args: Any) -> tuple[dict[str, Any], bytes]:
        """One sealed request and its sealed response; a refused request raises its typed error.

        The control channel rotates itself before its nonce budget (``nonce_budget`` messages per key
        and direction) runs out, so a long run never meets ``NonceExhaustedError``."""
        if op != "rotate" and self._chan is not None and self._chan.send.counter >= self.nonce_budget - 1:
            self.rotate()
        with self._lock:
            if self._chan is None or self._sock is None:
                raise DeviceError("not connected")
            head, ct = self._chan.seal(FrameType.REQUEST, {"op": op, "args": args}, payload)
            try:
                send_frame(self._sock, FrameType.SEALED, head, ct)
            except OSError as exc:
                raise DeviceError(f"device link failed: {exc}") from None
            frame = self._read()
            if frame.type is not FrameType.SEALED:
                raise FrameError(f"expected a sealed response, got {frame.type.name}")
            inner = self._chan.open(frame.header, bytes(frame.payload))
            resp = dict(inner.header)
            if not resp.pop("ok", False):
                raise error_from_code(str(resp.get("code")), str(resp.get("reason")))
            if op == "rotate":
                self._set_epoch(int(resp["epoch"]))
            return resp, bytes(inner.payload)

    def rotate(self, epoch: int | None = None) -> int:
        """Key update of the control channel to ``epoch`` (default: the next one); an explicit swap on
        both sides. Returns the new control epoch."""
        self.call("rotate", epoch=self.channel_epoch + 1 if epoch is None else epoch)
        self.rotations += 1
        return self.channel_epoch

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._stream = self._chan = None


def read_counters(socket_path: str, *, timeout: float = 2.0) -> dict[str, Any]:
    """The device's public counters over a short connection of their own: no session, no lock shared
    with the control channel, so telemetry keeps ticking while the device trains."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            send_frame(sock, FrameType.PING, {"counters": True})
            with sock.makefile("rb") as stream:
                frame = read_frame(stream)
    except OSError as exc:
        raise DeviceError(f"cannot read the device's counters: {exc}") from None
    if frame is None or frame.type is not FrameType.PONG:
        raise DeviceError("the device did not answer the counters request")
    return dict(frame.header)
