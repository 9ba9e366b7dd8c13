"""Data connections admitted per holder and window (issue 24): who is speaking, and how much it may hold.

A data connection's first DATA_OPEN carries an ``Admission``: the holder's name, the window's epoch, a
fresh nonce and an HMAC-SHA256 under the window's admission key (HKDF of its provisioning key, label
``keys.ADMIT_LABEL``) over (nonce, session, epoch, holder). Only the holder of that window has the key, so
an admitted connection speaks for that (holder, epoch), and every refusal on it is charged there. A
connection that has not been admitted (no credential, a wrong MAC, a nonce already used in this window, a
window that is not open) proves nothing about who sent it: it is refused, counted as anonymous and never
charged to a holder.

Budgets per admitted window (small, named): ``MAX_CONNECTIONS_PER_WINDOW`` connections at once and
``MAX_RINGS_PER_WINDOW`` shared-memory rings; bytes in flight follow from them (each connection reads into
its own few receive slots, so a window holds at most connections x slots x chunk size). An exhausted budget
is refused and charged to that window only: the other holders' windows have their own.

At RETURN (``close_window``) every connection of the window is admitted for nothing any more (its ring is
zeroed and unbound by the data plane): what it sends is refused as anonymous until it is admitted again
with the next window's key (a DATA_OPEN with an ``Admission`` on the open connection, no round trip of its
own). At most ``MAX_IDLE_CONNECTIONS`` such connections wait for their agent's next hand-off; beyond, the
oldest is shut down (its thread ends and unmaps its ring). Only a holder can make one (each needed a
window's key), and each window admits ``MAX_CONNECTIONS_PER_WINDOW``.

A connection waiting so is *parked*, bound to the holder its last admission named (the MAC proved it):
``relay(holder, frame)`` writes a frame (the next HANDOFF, its key wrapped for that holder by the orchestrator,
``Op.RELAY``) on that holder's newest parked connection, so the hand-off reaches the agent without crossing its
SSH link. Another holder's connection is never written to; a dead or missing one answers False (the
orchestrator's HANDOFF over the holder link is the fallback, and the copy the agent gets in any case).
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gputravel.core.protocol.errors import ProtocolError, StaleEpochError
from gputravel.core.protocol.holderlink import Admission
from gputravel.core.protocol.keys import admission_key, admission_mac

if TYPE_CHECKING:
    from gputravel.core.device.provision_window import ProvisionWindow
    from gputravel.core.device.session_keys import DeviceSecrets

class OpenWindow(Protocol):
    """What admission reads of the device's windows part (:class:`~gputravel.core.device.window.BufferWindows`,
    which holds the data plane, which holds these admissions: named by what it offers, not imported)."""

    @property
    def lock(self) -> threading.Lock: ...

    @property
    def window(self) -> ProvisionWindow | None: ...


__all__ = ["MAX_CONNECTIONS_PER_WINDOW", "MAX_IDLE_CONNECTIONS", "MAX_RINGS_PER_WINDOW", "AdmissionRefused", "Admissions",
           "OpenWindow", "Deliver"]

#: writes one encoded frame on a data connection (its send lock held); raises OSError when the connection is gone
Deliver = Callable[[bytes], None]

#: data connections one holder's window may have open at once (an honest agent opens one per hand-off)
MAX_CONNECTIONS_PER_WINDOW = 2
#: shared-memory rings one window may have bound (an honest agent maps one)
MAX_RINGS_PER_WINDOW = 2
#: connections admitted for no open window (de-admitted at their window's RETURN, kept by their agent for
#: its next window) at most; beyond, the oldest is shut down
MAX_IDLE_CONNECTIONS = 16
#: closed windows whose admission key (never the AEAD key) is kept, to charge a dead key's reuse to its holder
KEEP_CLOSED = 8


class AdmissionRefused(Exception):
    """A connection not admitted: ``error`` goes back to the peer; ``charge`` is the epoch to charge, or
    None (anonymous: nothing proves who sent it)."""

    def __init__(self, error: ProtocolError, charge: int | None) -> None:
        super().__init__(error.reason)
        self.error, self.charge = error, charge


@dataclass
class _Window:
    epoch: int
    holder: str
    akey: bytes | None
    nonces: set[bytes] = field(default_factory=set)
    conns: dict[socket.socket, Callable[[], None]] = field(default_factory=dict)
    closed: bool = False


class Admissions:
    """The admitted data connections of the device's windows (one per epoch; only the open one admits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[int, _Window] = {}
        #: parked connections (admitted for no open window), oldest first, with the holder they were last admitted for
        self._idle: OrderedDict[socket.socket, str] = OrderedDict()
        #: how to write on each admitted connection (``relay``), kept while it lives
        self._deliver: dict[socket.socket, Deliver] = {}

    def admit(self, windows: OpenWindow, keys: DeviceSecrets, admit: Admission, conn: socket.socket,
              on_return: Callable[[], None], deliver: Deliver | None = None) -> None:
        """Admit ``conn`` for ``admit.epoch`` or raise ``AdmissionRefused``. ``windows``: the device's windows
        part (its open window holds the key); ``keys``: its session part. A valid credential for a window closed since (its admission key is
        kept for the last ``KEEP_CLOSED`` windows) is refused as ``stale-epoch`` and charged to that window:
        only its holder could have made it."""
        with windows.lock:
            w, secrets = windows.window, keys.secrets
            key = w.key.key if w is not None and w.key is not None and w.epoch == admit.epoch else None
            if key is not None and w is not None:  # the device's part of the admission stage starts here
                w.mark("admit_read")
        with self._lock:
            known = self._windows.get(admit.epoch)
        akey = admission_key(key) if key is not None else (known.akey if known is not None else None)
        if akey is None or secrets is None:
            raise AdmissionRefused(StaleEpochError(f"no open window for epoch {admit.epoch}"), None)
        nonce = bytes.fromhex(admit.nonce)
        want = admission_mac(akey, nonce=nonce, session_id=secrets.session_id, epoch=admit.epoch, holder=admit.holder)
        if not hmac.compare_digest(want, bytes.fromhex(admit.mac)):
            raise AdmissionRefused(ProtocolError("the admission MAC does not verify", code="admission"), None)
        with self._lock:
            win = self._windows.get(admit.epoch)
            if win is None:
                win = self._windows[admit.epoch] = _Window(admit.epoch, admit.holder, akey)
                self._prune()
            if nonce in win.nonces:  # a captured credential replayed: whoever replays it is not known
                raise AdmissionRefused(ProtocolError("this admission was used before", code="admission"), None)
            win.nonces.add(nonce)
            if win.closed or key is None:
                raise AdmissionRefused(StaleEpochError(f"the window of epoch {admit.epoch} is closed: its key is "
                                                       "dead"), admit.epoch)
            if admit.holder != win.holder:
                raise AdmissionRefused(ProtocolError(f"window {admit.epoch} is {win.holder!r}'s",
                                                     code="admission"), admit.epoch)
            if len(win.conns) >= MAX_CONNECTIONS_PER_WINDOW:
                raise AdmissionRefused(ProtocolError(
                    f"window {admit.epoch} already has {MAX_CONNECTIONS_PER_WINDOW} data connections",
                    code="budget"), admit.epoch)
            for other in self._windows.values():  # a connection speaks for one window at a time
                other.conns.pop(conn, None)
            self._idle.pop(conn, None)
            win.conns[conn] = on_return
            if deliver is not None:
                self._deliver[conn] = deliver
        with windows.lock:  # the hand-off's admission stage ends here (``ProvisionWindow.marks``)
            if windows.window is not None and windows.window.epoch == admit.epoch:
                windows.window.mark("admitted")

    def _prune(self) -> None:
        """Forget the oldest windows with no connection left beyond ``KEEP_CLOSED`` (the lock held)."""
        idle = [e for e, win in self._windows.items() if not win.conns]
        for e in sorted(idle)[:max(0, len(idle) - KEEP_CLOSED)]:
            del self._windows[e]

    def leave(self, conn: socket.socket) -> None:
        """The connection ended."""
        with self._lock:
            for win in self._windows.values():
                win.conns.pop(conn, None)
            self._idle.pop(conn, None)
            self._deliver.pop(conn, None)

    def relay(self, holder: str, frame: bytes) -> bool:
        """Write ``frame`` on ``holder``'s newest parked connection; False where it has none or the write failed
        (that connection is then shut down: its agent opens a fresh one at its next hand-off)."""
        with self._lock:
            conn = next((c for c in reversed(self._idle) if self._idle[c] == holder and c in self._deliver), None)
            deliver = self._deliver.get(conn) if conn is not None else None
        if conn is None or deliver is None:
            return False
        try:
            deliver(frame)
        except OSError:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return False
        return True

    def parked(self, holder: str | None = None) -> int:
        """Parked connections (of ``holder``, or of all)."""
        with self._lock:
            return sum(1 for h in self._idle.values() if holder is None or h == holder)

    def connections(self, epoch: int | None = None) -> int:
        """Admitted connections (of ``epoch``, or of every window)."""
        with self._lock:
            return sum(len(w.conns) for e, w in self._windows.items() if epoch is None or e == epoch)

    def idle(self) -> int:
        """Connections admitted for no open window (waiting for their agent's next hand-off)."""
        with self._lock:
            return len(self._idle)

    def close_window(self, epoch: int | None = None) -> int:
        """RETURN: every connection of ``epoch`` is admitted for nothing from here on (``on_return``; it
        must be admitted again, with the next window's key, to send anything), the oldest idle ones beyond
        ``MAX_IDLE_CONNECTIONS`` are shut down; with ``epoch`` None (the device closes) every connection is
        shut down. Returns how many connections the window had."""
        with self._lock:
            wins = list(self._windows.values()) if epoch is None else [
                self._windows.setdefault(epoch, _Window(epoch, "", None))]
            returned: list[tuple[socket.socket, Callable[[], None]]] = []
            holders: dict[socket.socket, str] = {}
            for win in wins:
                win.closed = True
                returned += list(win.conns.items())
                holders.update(dict.fromkeys(win.conns, win.holder))
                win.conns.clear()
            shut: list[socket.socket] = []
            if epoch is None:
                shut = [c for c, _ in returned] + list(self._idle)
                self._idle.clear()
                self._deliver.clear()
            else:
                for c, _ in returned:
                    self._idle[c] = holders[c]
                while len(self._idle) > MAX_IDLE_CONNECTIONS:
                    oldest = self._idle.popitem(last=False)[0]
                    self._deliver.pop(oldest, None)
                    shut.append(oldest)
        for _, on_return in returned:
            on_return()
        for c in shut:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(returned)
