"""The device service's transport: the listeners (a Unix socket, and the TCP data port), one thread per
connection.

:class:`DeviceServer` owns the listeners and the budgets of connections not yet authenticated
(core/device/pending.py), reads each connection's first frame and hands it on: the control session (attestation,
authenticated key exchange, then sealed requests: core/device/control.py, one at a time) or a data connection
(ciphertext chunks in, acknowledgements out: core/device/dataconn.py). The data path runs in its own thread with
no busy Python threads beside it, so AES-GCM (which releases the GIL) runs at full speed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

from gputravel.core.device.control import serve_control
from gputravel.core.device.dataconn import serve_data
from gputravel.core.device.pending import Budget as _Budget
from gputravel.core.device.pending import Deadlines as _Deadlines
from gputravel.core.device.pending import Pending as _Pending
from gputravel.core.device.service import DeviceService
from gputravel.core.errors import GpuTravelError
from gputravel.core.procs import name_os_thread
from gputravel.core.protocol import FrameType, read_frame
from gputravel.core.protocol.devicelink import error_header, send_frame

#: Connections that have not authenticated yet (no session opened, no DATA_READY), at most, per listener, and
#: how long one may take in all to get there (a deadline for the whole hand-shake, not a per-read timeout):
#: a peer that stalls, trickles or floods costs at most this many threads for this long, and only on the
#: listener it reached. The Unix socket (0600, in a 0700 folder) is the orchestrator's and its same-host
#: holders'; the TCP data port, which any local user can reach, has a budget of its own. A full budget
#: takes a newcomer in the place of its oldest connection only once that one has waited ``EVICT_AFTER_S``
#: (shut down, ``evicted``), and else refuses the newcomer (``full``): a flood never pushes out a connection
#: admitted in time whose first frame is read late under load, and strangers hold places for at most
#: ``EVICT_AFTER_S`` each once others wait (core/device/pending.py).
MAX_PENDING = 32
HANDSHAKE_TIMEOUT_S = 10.0
EVICT_AFTER_S = 2.0


class DeviceServer:
    def __init__(self, service: DeviceService, socket_path: str, *, data_host: str | None = "127.0.0.1",
                 data_port: int = 0, max_pending: int = MAX_PENDING,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, evict_after: float | None = None) -> None:
        self.service = service
        self.socket_path = socket_path
        self.data_host = data_host
        self.data_port = data_port
        self.tcp: socket.socket | None = None
        self._stop = threading.Event()
        self._control_busy = threading.Lock()
        self.sock: socket.socket | None = None
        self.handshake_timeout = handshake_timeout
        # one budget per listener: strangers on the TCP port never take the places of the Unix socket's peers
        # a place is safe from newcomers for ``evict_after`` (EVICT_AFTER_S; half the deadline where that is less)
        if evict_after is None:
            evict_after = min(EVICT_AFTER_S, handshake_timeout / 2)
        self._pending_unix = _Budget(max_pending, evict_after)
        self._pending_tcp = _Budget(max_pending, evict_after)
        self._deadlines = _Deadlines()

    def _admit(self, conn: socket.socket, *, data_only: bool) -> None:
        """A thread for a new connection, in its listener's budget of ``max_pending`` unauthenticated ones
        (when full, the oldest one gives up its place, counted ``evicted``, if it has waited ``evict_after``;
        else the newcomer is refused at once, counted ``full``, with an ERROR frame that says so)."""
        pending = (self._pending_tcp if data_only else self._pending_unix).enter(conn)
        if pending is None:
            self.service.counts.count_refused("full")
            conn.settimeout(0.1)  # a fresh socket's send buffer is empty: the short ERROR frame never waits
            with contextlib.suppress(OSError):
                send_frame(conn, FrameType.ERROR, {"code": "busy", "reason": "every place for a connection "
                                                   "not yet admitted is taken: try again"})
            conn.close()
            return
        conn.settimeout(self.handshake_timeout)
        self._deadlines.add(pending, self.handshake_timeout)
        threading.Thread(target=self._handle, args=(conn, pending), kwargs={"data_only": data_only},
                         daemon=True).start()

    def serve_forever(self) -> None:
        self._deadlines.start()
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
        name_os_thread("device-accept")
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
                with contextlib.suppress(FileNotFoundError):  # a second close (the signal handler's) got there first
                    os.unlink(self.socket_path)

    def _handle(self, conn: socket.socket, pending: _Pending, *, data_only: bool = False) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # small buffer: a large payload read bypasses it and lands straight in the slot
        stream: Any = conn.makefile("rb", buffering=1 << 16)
        svc = self.service

        def refuse(code: str, reason: str) -> None:
            svc.counts.count_refused(code)
            send_frame(conn, FrameType.ERROR, {"code": code, "reason": reason})

        try:
            first = read_frame(stream)
            if first is None:
                if pending.expired:
                    svc.counts.count_refused(pending.reason)
                return
            if first.type is FrameType.ATTEST_REQUEST and data_only:
                refuse("frame", "the data port takes data connections only")
            elif first.type is FrameType.ATTEST_REQUEST:
                if not self._control_busy.acquire(blocking=False):
                    svc.counts.count_refused("busy")
                    send_frame(conn, FrameType.ERROR, {"code": "device", "reason": "a control session is active"})
                    return
                name_os_thread("device-control")  # the training steps run on this thread
                try:
                    serve_control(self.service, conn, stream, first, pending, on_stop=self.close)
                finally:
                    self._control_busy.release()
            elif first.type is FrameType.DATA_OPEN:
                name_os_thread("device-data")
                serve_data(self.service.data_path(), conn, stream, first, pending)
            elif first.type is FrameType.PING and first.header.get("counters") and not data_only:
                send_frame(conn, FrameType.PONG, svc.public_counters())
            else:
                refuse("frame", f"unexpected {first.type.name}")
        except TimeoutError:  # stalled before authenticating: its thread and place are given back
            if not pending.released or pending.expired:
                svc.counts.count_refused(pending.reason)
        except (OSError, ConnectionError):
            if pending.expired:
                svc.counts.count_refused(pending.reason)
        except GpuTravelError as exc:
            if pending.expired:
                svc.counts.count_refused(pending.reason)
            elif not pending.released:  # e.g. garbage as a first frame: counted like every rejection
                svc.counts.count_refused(exc.code)
            try:
                send_frame(conn, FrameType.ERROR, error_header(exc))
            except OSError:
                pass
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # a malformed handshake message
            svc.counts.rejected["frame"] += 1
            try:
                send_frame(conn, FrameType.ERROR, {"ok": False, "code": "frame", "reason": f"malformed message: {exc}"})
            except OSError:
                pass
        finally:
            pending.end()
            stream.close()
            conn.close()
