"""The orchestrator's side of the device link: attest, open a session, then one typed method per operation.

Speaks only the wire protocol (no torch, nothing of ``core.device``): ``DeviceClient.measure()``,
``.handoff(...)``, ``.train(...)``, ... each send one sealed request named by an ``Op``
(``core.protocol.devicelink``) and read back a typed answer (``core.protocol.deviceanswers``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from gputravel.core.attestation import AttestationResult, Evidence, code_measurement, verify_evidence
from gputravel.core.deviceclient.anchors import TrustAnchors
from gputravel.core.deviceclient.onloop import LoopCaller, grant_from, handoff_args
from gputravel.core.deviceclient.ringckpt import RingCheckpoint
from gputravel.core.errors import DeviceError, FrameError, GpuTravelError, error_from_code
from gputravel.core.handshake import Initiator, SessionSecrets
from gputravel.core.protocol import Frame, FrameType, read_frame
from gputravel.core.protocol.ckptring import CheckpointRing, ring_supported
from gputravel.core.protocol.deviceanswers import (
    AesRate,
    BufferDigest,
    Configured,
    DataPathConfig,
    DeviceInfo,
    DeviceState,
    DeviceStats,
    HandoffGrant,
    Measurement,
    ScrubResult,
    StreamEnded,
    TrainResult,
    WindowClosed,
    WindowStatus,
)
from gputravel.core.protocol.devicelink import (
    ControlChannel,
    Op,
    send_frame,
    send_sealed,
    session_context,
)
from gputravel.core.protocol.frames import MAX_PAYLOAD
from gputravel.core.protocol.stream import StreamHeader
from gputravel.core.protocol.wirejson import loads_bounded

__all__ = ["DeviceClient", "RingCheckpoint", "TrustAnchors"]


class DeviceClient:
    """A blocking client; the engine calls it from a worker thread (``asyncio.to_thread``), or from the loop
    itself for the window's key (``on_loop.handoff``)."""

    #: checkpoint-chunk requests kept in flight, so the device seals the next chunk while this side writes
    PIPELINE = 3
    #: slots of a checkpoint ring: the device seals up to this many chunks ahead of the writes
    RING_SLOTS = 4

    def __init__(self, socket_path: str, *, anchors: TrustAnchors, timeout: float = 600.0) -> None:
        self.socket_path = socket_path
        self.anchors = anchors
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stream: Any = None  # the socket's buffered reader
        self._chan: ControlChannel | None = None
        self.secrets: SessionSecrets | None = None
        self.attestation: AttestationResult | None = None
        #: messages per control-channel key before an automatic rotation (low in tests)
        self.nonce_budget = 2**32
        self.rotations = 0
        self._expected_code: str | None = None  # policy code "auto", resolved on the first attestation
        #: the calls made from the event loop with no worker thread (the window's key)
        self.on_loop = LoopCaller(self)

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
        initiator = Initiator(context=session_context(nonce, evidence.digest()))
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

    def _set_epoch(self, epoch: int) -> None:
        assert self.secrets is not None
        self._chan = ControlChannel.for_orchestrator(self.secrets, epoch)

    @property
    def channel_epoch(self) -> int:
        return self._chan.epoch if self._chan else -1

    @property
    def session_id(self) -> bytes:
        assert self.secrets is not None
        return bytes(self.secrets.session_id)

    def _read(self) -> Frame:
        try:
            frame = read_frame(self._stream) if self._stream is not None else None
        except (OSError, TimeoutError) as exc:
            raise DeviceError(f"device link failed: {exc}") from None
        if frame is None:
            raise DeviceError("the device service closed the connection")
        if frame.type is FrameType.ERROR:
            raise error_from_code(str(frame.header.get("code")), str(frame.header.get("reason")))
        return frame

    # --- sealed requests ------------------------------------------------------------------------
    def call(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
             **args: Any) -> tuple[dict[str, Any], bytes]:
        """One sealed request and its sealed response (the raw form under the typed methods); a refused
        request raises its typed error.

        The control channel rotates itself before its nonce budget (``nonce_budget`` messages per key
        and direction) runs out, so a long run never meets ``NonceExhaustedError``."""
        if op != Op.ROTATE and self._rotation_due():
            self.rotate()
        with self._lock:
            self.send_request(op, payload, attached=attached, **args)
            resp, out = self.read_answer()
            if isinstance(resp, GpuTravelError):
                raise resp
            if op == Op.ROTATE:
                self._set_epoch(int(resp["epoch"]))
            return resp, out

    def send_request(self, op: Op | str, payload: bytes | bytearray | memoryview = b"", *, attached: bool = False,
                     **args: Any) -> None:
        """Seal and send one request (the caller holds the lock)."""
        if self._chan is None or self._sock is None:
            raise DeviceError("not connected")
        head, ct = self._chan.seal(FrameType.REQUEST, {"op": str(op), "args": args}, payload, attached=attached)
        try:
            send_sealed(self._sock, head, ct, payload if attached else b"")
        except OSError as exc:
            raise DeviceError(f"device link failed: {exc}") from None

    def read_answer(self) -> tuple[dict[str, Any] | GpuTravelError, bytes]:
        """Read and open one response (the caller holds the lock). A refusal comes back as its typed error
        (not raised, so a pipelined caller can still read the answers it has outstanding); a broken link raises."""
        if self._chan is None:
            raise DeviceError("not connected")
        frame = self._read()
        if frame.type is not FrameType.SEALED:
            raise FrameError(f"expected a sealed response, got {frame.type.name}")
        inner = self._chan.open(frame.header, frame.payload)
        resp = dict(inner.header)
        if not resp.pop("ok", False):
            return error_from_code(str(resp.get("code")), str(resp.get("reason"))), b""
        return resp, bytes(inner.payload)

    def claim(self) -> socket.socket | None:
        """The link for one request by a caller that will not wait for it (``on_loop``): its socket, with the lock
        now held (write with ``send_request``, read with ``read_answer``, then ``release``), or None where another
        thread is mid-request, a rotation is due or there is no link."""
        if self._sock is None or self._chan is None or self._rotation_due() or not self._lock.acquire(blocking=False):
            return None
        return self._sock

    def _rotation_due(self) -> bool:
        """The control channel's key is one message short of its nonce budget: ``call`` rotates it first."""
        return self._chan is not None and self._chan.send.counter >= self.nonce_budget - 1

    def release(self) -> None:
        """Free the link ``claim`` took."""
        self._lock.release()

    def attest(self) -> AttestationResult:
        """A fresh attestation inside the session (each visit starts with one)."""
        nonce = os.urandom(32)
        head, _ = self.call(Op.ATTEST, nonce=nonce.hex())
        result = self._verify(Evidence.from_dict(head["evidence"]), nonce)
        if self.attestation is not None and result.device_id != self.attestation.device_id:
            raise DeviceError("a different device answered inside the session")
        return result

    def rotate(self, epoch: int | None = None) -> int:
        """Key update of the control channel to ``epoch`` (default: the next one); an explicit swap on
        both sides. Returns the new control epoch."""
        self.call(Op.ROTATE, epoch=self.channel_epoch + 1 if epoch is None else epoch)
        self.rotations += 1
        return self.channel_epoch

    def shutdown(self) -> None:
        """Stop the device service (after its answer, it closes)."""
        self.call(Op.SHUTDOWN)

    def info(self) -> DeviceInfo:
        return DeviceInfo.from_wire(self.call(Op.INFO)[0])

    def configure(self, program: bytes) -> Configured:
        """Upload the training program into the code region; the device builds the model from it."""
        return Configured.from_wire(self.call(Op.CONFIGURE, program)[0])

    def measure(self, *, mac_key: bytes = b"", digest: bool = True) -> Measurement:
        """The code and model measurement: the model's SHA-256 digest (``digest``) and, with a 32-byte
        ``mac_key``, its AES-GMAC under that key (the key rides the sealed control channel)."""
        return Measurement.from_wire(self.call(Op.MEASURE, mac_key, digest=digest)[0])

    def handoff(self, *, epoch: int, offset: int, length: int, chunk_size: int,
                relay: tuple[str, dict[str, Any]] | None = None) -> HandoffGrant:
        """A provisioning key for bytes [offset, offset+length) of the buffer in ``epoch``, typed and checked
        once here (a malformed grant is the device's fault: ``DeviceError``). ``relay`` (holder, HANDOFF header
        with its key wrapped for that holder): the device writes it on the holder's parked data connection as the
        window opens (``HandoffGrant.relayed``)."""
        return grant_from(self.call(Op.HANDOFF, **handoff_args(epoch, offset, length, chunk_size, relay))[0])

    def relay(self, *, holder: str, epoch: int, handoff: dict[str, Any]) -> bool:
        """Have the device write ``handoff`` (a HANDOFF header whose key is wrapped for ``holder``) on that
        holder's parked data connection; whether it was written (False: no such connection, or it is gone)."""
        head, _ = self.call(Op.RELAY, holder=holder, epoch=epoch, handoff=handoff)
        return head.get("delivered") is True

    def close_window(self, *, epoch: int) -> WindowClosed:
        return WindowClosed.from_wire(self.call(Op.CLOSE_WINDOW, epoch=epoch)[0])

    def window_status(self) -> WindowStatus:
        return WindowStatus.from_wire(self.call(Op.WINDOW_STATUS)[0])

    def train(self, *, train_off: int, train_len: int, val_off: int, val_len: int, fmt: str,
              steps: int | None = None, budget_s: float | None = None) -> TrainResult:
        """One slice of TRAIN: ``steps`` steps (default the program's steps per visit), cut short after
        ``budget_s`` seconds (``done`` False: no validation, no digest)."""
        args: dict[str, Any] = {"train_off": train_off, "train_len": train_len, "val_off": val_off,
                                "val_len": val_len, "fmt": fmt}
        if steps is not None:
            args["steps"] = steps
        if budget_s is not None:
            args["budget_s"] = budget_s
        head, payload = self.call(Op.TRAIN, **args)
        return TrainResult.from_wire_with_losses(head, payload)

    def scrub(self) -> ScrubResult:
        return ScrubResult.from_wire(self.call(Op.SCRUB)[0])

    def checkpoint(self, key: bytes, header: StreamHeader, sink: Callable[[int, memoryview], None], *,
                   ring: bool | None = None) -> StreamEnded:
        """Stream a checkpoint: the device seals its state chunk by chunk under the run's checkpoint ``key``
        and ``header``; each sealed chunk goes to ``sink(kind, sealed)`` unopened (kind 0 data, 1 the end
        chunk). No side holds the whole state serialised. Through a shared-memory ring where this host
        can make one (``ring`` None or True), else as chunks attached to control answers (``ring=False``)."""
        if ring is None:
            ring = ring_supported()
        if ring:
            pending = self.checkpoint_begin(key, header)
            try:
                pending.drain(sink)
            except BaseException:
                with contextlib.suppress(Exception):  # the device's account; the drain's error is the one told
                    self.checkpoint_end(pending)
                raise
            return self.checkpoint_end(pending)
        return self._checkpoint_attached(key, header, sink)

    def checkpoint_begin(self, key: bytes, header: StreamHeader, *, snapshot: bool = False) -> RingCheckpoint:
        """Open a checkpoint through a new shared-memory ring: the device seals on a thread of its own (of a
        copy of its state in its own memory with ``snapshot``: then training may go on at once). Drain it
        with :meth:`RingCheckpoint.drain` (any thread: the control link is not used), then call
        :meth:`checkpoint_end`, which answers what the device sealed."""
        ring = CheckpointRing.create(slots=self.RING_SLOTS, slot_bytes=header.max_sealed)
        try:
            begun, _ = self.call(Op.CHECKPOINT, key, header=header.to_dict(), ring=ring.to_wire(), snapshot=snapshot)
        except BaseException:
            ring.close()
            raise
        return RingCheckpoint(ring, header, chunks=int(begun["chunks"]), snapshot_s=float(begun.get("snapshot_s", 0)))

    def checkpoint_end(self, pending: RingCheckpoint) -> StreamEnded:
        """The device's account of a ring checkpoint (once its thread is done): a refusal if it failed."""
        try:
            head, _ = self.call(Op.CHECKPOINT_END)
        finally:
            pending.ring.close()
        return StreamEnded.from_wire(head)

    def _checkpoint_attached(self, key: bytes, header: StreamHeader,
                             sink: Callable[[int, memoryview], None]) -> StreamEnded:
        begun, _ = self.call(Op.CHECKPOINT, key, header=header.to_dict())
        n = int(begun["chunks"])  # data chunks and the end chunk
        if self._chan is not None and self._chan.send.counter + n + 2 >= self.nonce_budget:
            self.rotate()
        # Pipelined: up to PIPELINE requests ahead, so the device seals chunk k+1 while this side writes chunk k.
        done: StreamEnded | None = None
        refused: GpuTravelError | None = None
        with self._lock:
            sent = received = 0
            while received < n:
                while sent < n and sent - received < self.PIPELINE:
                    self.send_request(Op.CHECKPOINT_NEXT)
                    sent += 1
                head, sealed = self.read_answer()
                received += 1
                if isinstance(head, GpuTravelError):
                    refused = refused or head
                    continue
                if refused is not None:
                    continue
                kind = int(head.get("kind", -1))
                if kind not in (0, 1) or len(sealed) > header.max_sealed or (kind == 1) != (received == n):
                    refused = FrameError(f"the device sent a bad checkpoint chunk {received - 1} (kind {kind}, "
                                         f"{len(sealed)} bytes)")
                    continue
                sink(kind, memoryview(sealed))
                if head.get("done"):
                    done = StreamEnded.from_wire(head)
        if refused is not None:
            raise refused
        if done is None:
            raise FrameError("the checkpoint stream ended without its end chunk")
        return done

    def restore(self, key: bytes, header: StreamHeader,
                records: Iterable[tuple[int, bytes | bytearray | memoryview]]) -> DeviceState:
        """Stream sealed checkpoint chunks (``(kind, sealed)``, as stored) into the device, which opens each under
        ``key`` and writes it straight into the model; returns the digest of the model it then holds."""
        self.call(Op.RESTORE, key, header=header.to_dict())
        for kind, sealed in records:
            self.call(Op.RESTORE_CHUNK, sealed, attached=True, kind=kind)  # already sealed: not re-encrypted
        return DeviceState.from_wire(self.call(Op.RESTORE_END)[0])

    def stats(self, *, since: int = 0) -> DeviceStats:
        """Counters; per-epoch rejections (in the payload) only for the epochs changed after ``since`` (a
        previous answer's ``rejection_gen``)."""
        head, payload = self.call(Op.STATS, since=since)
        # rejected_by_epoch rides in the payload (bounded like every peer's JSON: a FrameError, never a RecursionError)
        extra = loads_bounded(payload, max_bytes=MAX_PAYLOAD, what="stats payload") if payload else {}
        return DeviceStats.from_wire({**head, **(extra if isinstance(extra, dict) else {})})

    def aes_rate(self, *, chunk: int, seconds: float = 0.3) -> AesRate:
        return AesRate.from_wire(self.call(Op.AES_RATE, chunk=chunk, seconds=seconds)[0])

    def tamper(self, *, region: str) -> str:
        """Fault injection (devices that allow it): corrupt ``region``; returns the region tampered."""
        return str(self.call(Op.TAMPER, region=region)[0]["tampered"])

    def digest(self, *, offset: int, length: int) -> BufferDigest:
        """Debug op (fault injection on): SHA-256 of buffer bytes [offset, offset+length)."""
        return BufferDigest.from_wire(self.call(Op.DIGEST, offset=offset, length=length)[0])

    def set_data_path(self, *, parallel_auth: bool | None = None, overlap: bool | None = None,
                      workers: int = 0) -> DataPathConfig:
        head, _ = self.call(Op.SET_DATA_PATH, parallel_auth=parallel_auth, overlap=overlap, workers=workers)
        return DataPathConfig.from_wire(head)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._stream = self._chan = None
