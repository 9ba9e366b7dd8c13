"""The device service's transport: a Unix socket, one thread per connection.

A connection is either the control channel (attestation, authenticated key exchange, then sealed
requests) or a data connection (ciphertext chunks in, acknowledgements out). The data path runs in
its own thread with no busy Python threads beside it, so AES-GCM (which releases the GIL) runs at
full speed.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
from typing import Any

from gputravel.core.device.link import ControlChannel, error_header, send_frame, session_context
from gputravel.core.device.service import MAX_CHUNK, DeviceService, Reply
from gputravel.core.errors import GpuTravelError, ProtocolError
from gputravel.core.protocol import TAG_LEN, FrameError, FrameType, read_frame
from gputravel.core.protocol.frames import read_frame_into


class _GrowingBuffer:
    """A receive buffer that grows to the largest payload seen (chunk size + tag), once."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def get(self, n: int) -> bytearray:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return self.buf


#: Connections that have not authenticated yet (no session opened, no DATA_READY), at most, and how long
#: one may take to get there: a peer that stalls or floods costs at most this many threads for this long.
MAX_PENDING = 32
HANDSHAKE_TIMEOUT_S = 10.0


class _Pending:
    """One connection's place among the unauthenticated ones: released (and its time limit lifted) once it
    authenticates, or when it ends."""

    __slots__ = ("conn", "released", "sem")

    def __init__(self, sem: threading.BoundedSemaphore, conn: socket.socket) -> None:
        self.sem, self.conn, self.released = sem, conn, False

    def authenticated(self) -> None:
        if not self.released:
            self.released = True
            self.conn.settimeout(None)
            self.sem.release()

    def end(self) -> None:
        if not self.released:
            self.released = True
            self.sem.release()


class DeviceServer:
    def __init__(self, service: DeviceService, socket_path: str, *, data_host: str | None = "127.0.0.1",
                 data_port: int = 0, max_pending: int = MAX_PENDING,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.service = service
        self.socket_path = socket_path
        self.data_host = data_host
        self.data_port = data_port
        self.tcp: socket.socket | None = None
        self._stop = threading.Event()
        self._control_busy = threading.Lock()
        self.sock: socket.socket | None = None
        self.handshake_timeout = handshake_timeout
        self._pending = threading.BoundedSemaphore(max_pending)

    def _admit(self, conn: socket.socket, *, data_only: bool) -> None:
        """A thread for a new connection if fewer than ``max_pending`` wait to authenticate; else it is
        closed at once and counted (``busy``)."""
        if not self._pending.acquire(blocking=False):
            self.service.count_refused("busy")
            conn.close()
            return
        conn.settimeout(self.handshake_timeout)
        threading.Thread(target=self._handle, args=(conn, _Pending(self._pending, conn)),
                         kwargs={"data_only": data_only}, daemon=True).start()

    def serve_forever(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.socket_path)
        finally:
            os.umask(old)
        self.sock.listen(64)
        ready = f"READY {self.socket_path}"
        if self.data_host:
            # The data port (the direct path): data connections only; sealed chunks need no further protection.
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((self.data_host, self.data_port))
            self.tcp.listen(64)
            ready += f" {self.tcp.getsockname()[1]}"
            threading.Thread(target=self._accept_data, daemon=True).start()
        print(ready, flush=True)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    break
                self._admit(conn, data_only=False)
        finally:
            self.close()

    def _accept_data(self) -> None:
        while not self._stop.is_set() and self.tcp is not None:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._admit(conn, data_only=True)

    def close(self) -> None:
        self._stop.set()
        if self.tcp is not None:
            try:
                self.tcp.close()
            finally:
                self.tcp = None
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                if os.path.exists(self.socket_path):
                    os.unlink(self.socket_path)

    def _handle(self, conn: socket.socket, pending: _Pending, *, data_only: bool = False) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # small buffer: a large payload read bypasses it and lands straight in the slot
        stream: Any = conn.makefile("rb", buffering=1 << 16)
        svc = self.service

        def refuse(code: str, reason: str) -> None:
            svc.count_refused(code)
            send_frame(conn, FrameType.ERROR, {"code": code, "reason": reason})

        try:
            first = read_frame(stream)
            if first is None:
                return
            if first.type is FrameType.ATTEST_REQUEST and data_only:
                refuse("frame", "the data port takes data connections only")
            elif first.type is FrameType.ATTEST_REQUEST:
                if not self._control_busy.acquire(blocking=False):
                    svc.count_refused("busy")
                    send_frame(conn, FrameType.ERROR, {"code": "device", "reason": "a control session is active"})
                    return
                try:
                    self._control(conn, stream, first, pending)
                finally:
                    self._control_busy.release()
            elif first.type is FrameType.DATA_OPEN:
                self._data(conn, stream, first, pending)
            elif first.type is FrameType.PING and first.header.get("counters") and not data_only:
                send_frame(conn, FrameType.PONG, svc.public_counters())
            else:
                refuse("frame", f"unexpected {first.type.name}")
        except TimeoutError:  # stalled before authenticating: its thread and place are given back
            if not pending.released:
                svc.count_refused("timeout")
        except (OSError, ConnectionError):
            pass
        except GpuTravelError as exc:
            if not pending.released:  # e.g. garbage as a first frame: counted like every rejection
                svc.count_refused(exc.code)
            try:
                send_frame(conn, FrameType.ERROR, error_header(exc))
            except OSError:
                pass
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # a malformed handshake message
            svc.rejected["frame"] += 1
            try:
                send_frame(conn, FrameType.ERROR, {"ok": False, "code": "frame", "reason": f"malformed message: {exc}"})
            except OSError:
                pass
        finally:
            pending.end()
            stream.close()
            conn.close()

    # --- control -------------------------------------------------------------------------
    def _control(self, conn: socket.socket, stream: Any, first: Any, pending: _Pending) -> None:
        svc = self.service
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
                head, ct = chan.seal(FrameType.RESPONSE, {"ok": True, **reply.header}, reply.payload)
            except Exception as exc:  # the device reports, never dies, on a bad request (error_header types it)
                reply = None
                head, ct = chan.seal(FrameType.RESPONSE, error_header(exc), b"")
            send_frame(conn, FrameType.SEALED, head, ct)
            if reply is not None and reply.rekey_to is not None:
                chan = ControlChannel.for_device(secrets, reply.rekey_to)
            if reply is not None and reply.stop:
                self.close()
                return

    # --- data ----------------------------------------------------------------------------
    def _data(self, conn: socket.socket, stream: Any, first: Any, pending: _Pending) -> None:
        svc = self.service
        secrets = svc.secrets
        if secrets is None or first.header.get("session") != secrets.session_id.hex():
            svc.count_refused("stale-epoch")
            send_frame(conn, FrameType.ERROR, {"code": "stale-epoch", "reason": "no such session"})
            return
        send_frame(conn, FrameType.DATA_READY, {"session": secrets.session_id.hex()})
        pending.authenticated()  # bound to the open session; each chunk is authenticated on its own
        workers = int(svc.data_opts.get("workers", 0))
        if workers:
            self._data_pipelined(conn, stream, workers)
        else:
            self._data_serial(conn, stream)

    def _non_chunk(self, conn: socket.socket, frame: Any, send: Any) -> bool:
        """Handle a frame that is not a chunk; False ends the connection."""
        if frame.type is FrameType.PING:
            send(FrameType.PONG, frame.header)
            return True
        if frame.type is FrameType.BYE:
            return False
        # e.g. an attempt to read the buffer back: the data port only takes chunks in
        self.service.count_rejection("frame", frame.header.get("e"))
        send(FrameType.ERROR, {"code": "frame", "reason": f"unexpected {frame.type.name}", "s": frame.header.get("s")})
        return True

    def _data_serial(self, conn: socket.socket, stream: Any) -> None:
        """Receive, authenticate+decrypt, acknowledge: one chunk at a time (both optimisations off).
        One preallocated payload buffer: the kernel copies a chunk's ciphertext into it and AES-GCM
        decrypts it from there straight into the device buffer."""
        svc = self.service
        payload = _GrowingBuffer()

        def send(ftype: FrameType, header: dict[str, Any]) -> None:
            send_frame(conn, ftype, header)

        while True:
            try:
                frame = read_frame_into(stream, payload.get, max_payload=MAX_CHUNK + TAG_LEN)
            except FrameError as exc:
                svc.count_rejection(exc.code)
                send_frame(conn, FrameType.ERROR, error_header(exc))
                return
            if frame is None:
                return
            if frame.type is FrameType.CHUNK:
                try:
                    ack = svc.accept_chunk(frame.header, frame.payload)
                except ProtocolError as exc:
                    send_frame(conn, FrameType.ERROR, {**error_header(exc), "s": frame.header.get("s")})
                    continue
                send_frame(conn, FrameType.ACK, ack)
            elif not self._non_chunk(conn, frame, send):
                return

    def _data_pipelined(self, conn: socket.socket, stream: Any, workers: int) -> None:
        """Overlap and parallel authentication: this thread keeps receiving chunk k+1, k+2, ... into a
        ring of payload slots while a pool of ``workers`` threads authenticates and decrypts earlier
        chunks straight into the buffer (AES-GCM releases the GIL, and this process runs no other busy
        Python thread). Acknowledgements go out as chunks complete, in any order."""
        from concurrent.futures import ThreadPoolExecutor

        svc = self.service
        n_slots = 2 * workers + 2
        slots = [_GrowingBuffer() for _ in range(n_slots)]
        free: queue.Queue[int] = queue.Queue()
        for i in range(n_slots):
            free.put(i)
        send_lock = threading.Lock()

        def send(ftype: FrameType, header: dict[str, Any]) -> None:
            with send_lock:
                send_frame(conn, ftype, header)

        def work(slot: int, header: dict[str, Any], payload: memoryview) -> None:
            try:
                ack = svc.accept_chunk(header, payload)
                send(FrameType.ACK, ack)
            except ProtocolError as exc:
                send(FrameType.ERROR, {**error_header(exc), "s": header.get("s")})
            except OSError:
                pass
            finally:
                free.put(slot)

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="auth") as pool:
            while True:
                slot = free.get()
                try:
                    frame = read_frame_into(stream, slots[slot].get, max_payload=MAX_CHUNK + TAG_LEN)
                except FrameError as exc:
                    svc.count_rejection(exc.code)
                    send(FrameType.ERROR, error_header(exc))
                    return
                if frame is None:
                    return
                if frame.type is FrameType.CHUNK:
                    pool.submit(work, slot, frame.header, frame.payload)  # type: ignore[arg-type]
                    continue
                free.put(slot)
                if not self._non_chunk(conn, frame, send):
                    return


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    from gputravel.core.device.service import load_service

    parser = argparse.ArgumentParser(prog="python -m gputravel.core.device",
                                     description="Run the emulated confidential GPU's device service.")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--cc-mode", default="on", choices=["on", "off", "devtools"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--allow-fault-injection", action="store_true")
    parser.add_argument("--data-host", default="127.0.0.1", help="address of the TCP data port ('' for none)")
    parser.add_argument("--data-port", type=int, default=0)
    ns = parser.parse_args(argv)
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    try:
        service = load_service(ns.state_dir, buffer_bytes=ns.buffer_bytes, device=ns.device, cc_mode=ns.cc_mode,
                               allow_fault_injection=ns.allow_fault_injection)
    except GpuTravelError as exc:
        print(f"ERROR {exc}", flush=True)
        sys.exit(exc.exit_code)
    DeviceServer(service, ns.socket, data_host=ns.data_host or None, data_port=ns.data_port).serve_forever()
