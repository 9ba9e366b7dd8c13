"""The device's unauthenticated connections: one place each in its listener's budget, one deadline for
the whole hand-shake (a watchdog thread shuts the connection down at it), released once it authenticates."""

from __future__ import annotations

import heapq
import socket
import threading
import time

__all__ = ["Deadlines", "Pending"]


class Deadlines:
    """One watchdog thread for every unauthenticated connection's deadline (no thread per connection): at its
    deadline a connection still pending is shut down, so its handling thread's read returns at once."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Pending]] = []
        self._cond = threading.Condition()
        self._count = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="handshake-deadlines", daemon=True)
                self._thread.start()

    def add(self, pending: Pending, deadline_s: float) -> None:
        self.start()
        with self._cond:
            self._count += 1
            heapq.heappush(self._heap, (time.monotonic() + deadline_s, self._count, pending))
            self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, _, pending = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
            pending.expire()


class Pending:
    """One connection's place among a listener's unauthenticated ones: released (and its deadline lifted)
    once it authenticates, or when it ends. At the deadline the connection is shut down (``expired``)."""

    __slots__ = ("conn", "released", "sem", "expired", "_lock")

    def __init__(self, sem: threading.BoundedSemaphore, conn: socket.socket) -> None:
        self.sem, self.conn, self.released, self.expired = sem, conn, False, False
        self._lock = threading.Lock()

    def expire(self) -> None:
        with self._lock:
            if self.released:
                return
            self.expired = True
        try:
            self.conn.shutdown(socket.SHUT_RDWR)  # the handling thread's read returns: it ends the connection
        except OSError:
            pass

    def authenticated(self) -> None:
        if self._release():
            self.conn.settimeout(None)

    def end(self) -> None:
        self._release()

    def _release(self) -> bool:
        with self._lock:
            if self.released:
                return False
            self.released = True
        self.sem.release()
        return True
