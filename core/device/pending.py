"""The device's unauthenticated connections: one place each in its listener's budget, one deadline for
the whole hand-shake (a watchdog thread shuts the connection down at it), released once it authenticates.

When a listener's places are all taken, a newcomer takes the place of the oldest connection that has
waited past its *eviction age* (``evict_after``, shorter than the hand-shake deadline); a connection
younger than that keeps its place, and where every place is that young the newcomer is refused (``full``).
So a connection admitted in time is never pushed out by a flood that arrives before its first frame is
read (an honest holder's DATA_OPEN, late under load), and a stranger holds a place for at most the
eviction age once others are waiting."""

from __future__ import annotations

import heapq
import socket
import threading
import time
from collections import OrderedDict

from gputravel.core.procs import name_os_thread

__all__ = ["Budget", "Deadlines", "Pending"]


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
        name_os_thread()
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


class Budget:
    """One listener's places for unauthenticated connections. When every place is taken, a new connection
    takes the place of the oldest one if that one has waited ``evict_after`` seconds or more (it is shut
    down: ``evicted``); otherwise the newcomer gets no place (``enter`` returns None: the caller refuses it
    as ``full``). Places are kept in arrival order, so the oldest is the first one."""

    def __init__(self, places: int, evict_after: float) -> None:
        self.places = places
        self.evict_after = evict_after
        self._lock = threading.Lock()
        self._live: OrderedDict[int, Pending] = OrderedDict()

    def enter(self, conn: socket.socket) -> Pending | None:
        """A place for ``conn``, or None where every place is taken by a connection younger than
        ``evict_after`` (nothing is shut down then)."""
        now = time.monotonic()
        pending = Pending(self, conn, now)
        oldest: Pending | None = None
        with self._lock:
            if len(self._live) >= self.places:
                first = next(iter(self._live.values()))
                if now - first.since < self.evict_after:
                    return None
                oldest = self._live.popitem(last=False)[1]
            self._live[id(pending)] = pending
        if oldest is not None:
            oldest.evict()
        return pending

    def leave(self, pending: Pending) -> None:
        with self._lock:
            self._live.pop(id(pending), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


class Pending:
    """One connection's place among a listener's unauthenticated ones: released (and its deadline lifted)
    once it authenticates, or when it ends. At the deadline, or when a newer connection takes its place,
    the connection is shut down (``expired``; ``evicted`` for the latter)."""

    __slots__ = ("conn", "released", "budget", "expired", "evicted", "since", "_lock")

    def __init__(self, budget: Budget, conn: socket.socket, since: float) -> None:
        self.budget, self.conn, self.released, self.expired, self.evicted = budget, conn, False, False, False
        self.since = since  # time.monotonic() at admission: its eviction age counts from here
        self._lock = threading.Lock()

    @property
    def reason(self) -> str:
        """Why it was cut off: ``evicted`` (its place was taken) or ``timeout`` (its deadline passed)."""
        return "evicted" if self.evicted else "timeout"

    def expire(self) -> None:
        with self._lock:
            if self.released:
                return
            self.expired = True
        self._shut()

    def evict(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = self.expired = self.evicted = True  # its place is already the newcomer's
        self._shut()

    def _shut(self) -> None:
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
        self.budget.leave(self)
        return True
