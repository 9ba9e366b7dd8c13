"""The shared-memory ring of bounce slots: the direct path's same-host mode.

Where a holder's agent and the device service share a host (as a CVM shares pages with its GPU),
ciphertext need not cross a socket. The device creates, for one hand-off (one epoch), a ring of
``slots`` bounce slots of ``slot_bytes`` each in an anonymous shared-memory file (``memfd``: no name
in /dev/shm or anywhere else, mode 0600, sealed against shrinking and growing so neither side can
cut the mapping from under the other) and passes its descriptor to the agent over the data
connection's Unix socket (``SCM_RIGHTS``). Only the two processes holding that descriptor can map it.

The agent seals chunk ``s`` straight into a free slot (``encrypt_into``); the socket then carries only
small frames: ``CHUNK {e, s, o, n, slot}`` with no payload (the slot id), ``ACK {s, slot}`` /
``ERROR {s, slot, code}`` back (each returns the slot's credit: the agent reuses a slot only after its
chunk was acknowledged or refused, so a refused chunk is retransmitted from the slot as is).
The device authenticates and decrypts from the slot (``decrypt_into``) into the buffer window.
The ring belongs to one holder's data connection (one per holder session: mapped once) and is bound to
one epoch at a time: bound at the hand-off, zeroed and released at RETURN.

Nothing in the ring is trusted: a notification names a slot and a length, which ``RingReceiver.take``
checks against the ring (``FrameError``), and then the chunk goes through exactly the checks of the
socket path (epoch, window, replay, tag), so garbage, replays, stale epochs and out-of-window offsets
written into the ring are rejected by the same named errors and counted the same way. At RETURN the
device zeroes the ring and releases it (``release``), like the key it was bound to: a notification naming
it is refused (``StaleEpochError``) until the holder's next hand-off binds it again. Both sides unmap it
(``close``) when the holder's data connection ends.

Standard library only (the holder agent imports it; torch never).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import stat
from dataclasses import dataclass, field
from typing import Any

from gputravel.core.protocol.cipher import TAG_LEN
from gputravel.core.protocol.errors import FrameError, StaleEpochError
from gputravel.core.protocol.frames import PREFIX, Frame, _parse_header, _parse_prefix
from gputravel.core.protocol.wire import FrameMessage, Int, bounds

#: Most slots a ring may have, and most bytes one ring may map (both sides refuse more).
MAX_SLOTS = 256
MAX_RING_BYTES = 1 << 28
#: The seals a ring must carry before the device or an agent maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def ring_supported() -> bool:
    """True where this host can make a ring (Linux ``memfd_create`` with sealing)."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(socket, "send_fds")


@dataclass(frozen=True, slots=True)
class RingSpec(FrameMessage):
    """The shape of one ring and the epoch it belongs to (a ``FrameMessage``: a malformed one is a ``FrameError``)."""

    epoch: int = field(metadata=bounds(Int()))
    slots: int = field(metadata=bounds(Int()))
    slot_bytes: int = field(metadata=bounds(Int()))

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def check(self) -> RingSpec:
        """Raise ``FrameError`` unless the shape is sane."""
        if not 1 <= self.slots <= MAX_SLOTS:
            raise FrameError(f"ring of {self.slots} slots: 1..{MAX_SLOTS} allowed")
        if not TAG_LEN < self.slot_bytes or self.nbytes > MAX_RING_BYTES:
            raise FrameError(f"ring of {self.slots} x {self.slot_bytes} bytes is outside the limits "
                             f"(slots over {TAG_LEN} bytes, at most {MAX_RING_BYTES} bytes in all)")
        return self

    def validated(self) -> RingSpec:
        return self.check()


class ShmRing:
    """One process's mapping of a ring. ``create`` on the device, ``attach`` on the agent.

    The ring is *bound* to one epoch at a time (``spec.epoch``; ``bound`` is False once released): the
    device binds it at a hand-off and releases it (zeroed) at RETURN; a released ring is read by nobody.
    The mapping itself lives as long as the holder's data connection (one ring per holder session): mapping
    fresh shared pages costs more per hand-off than the chunks' own AES-GCM work (docs/provisioning.md)."""

    __slots__ = ("spec", "bound", "_fd", "_map", "closed")

    def __init__(self, fd: int, spec: RingSpec) -> None:
        self.spec = spec
        self.bound = True
        self._fd = fd
        # MAP_POPULATE: the slots are mapped in one go instead of one page fault per page of the first chunks
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        self._map: mmap.mmap | None = mmap.mmap(fd, spec.nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.closed = False

    @classmethod
    def create(cls, spec: RingSpec) -> ShmRing:
        """A new ring: anonymous, 0600, zero-filled, sealed against resizing."""
        spec.check()
        fd = os.memfd_create(f"gputravel-ring-e{spec.epoch}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, spec.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            return cls(fd, spec)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, spec: RingSpec) -> ShmRing:
        """Map a ring received from the peer; takes ownership of ``fd``. Refuses (``FrameError``) a
        descriptor that is not a sealed memfd of exactly the announced size (a short or shrinkable file
        would fault the mapping from under its reader)."""
        try:
            spec.check()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != spec.nbytes:
                raise FrameError(f"ring descriptor is not a {spec.nbytes}-byte shared-memory file")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise FrameError(f"ring file mode {stat.S_IMODE(st.st_mode):o} lets others in (0600 expected)")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise FrameError("ring file is not sealed against resizing")
            return cls(fd, spec)
        except BaseException:
            os.close(fd)
            raise

    def fileno(self) -> int:
        return self._fd

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise StaleEpochError(f"the ring of epoch {self.spec.epoch} is closed")
        return self._map

    def same_shape(self, spec: RingSpec) -> bool:
        return (spec.slots, spec.slot_bytes) == (self.spec.slots, self.spec.slot_bytes)

    def bind(self, epoch: int) -> None:
        """Serve the hand-off of ``epoch`` (the ring was released, or is new)."""
        self._mapped()
        self.spec = RingSpec(epoch, self.spec.slots, self.spec.slot_bytes)
        self.bound = True

    def release(self) -> None:
        """RETURN: zero every slot and unbind; nothing in it is read until the next ``bind``."""
        self.bound = False
        if self._map is not None:
            self.zero()

    def slot(self, k: int, length: int | None = None) -> memoryview:
        """Slot ``k`` (writable), or its first ``length`` bytes (one view, for the data path); drop the view
        before ``close``."""
        if type(k) is not int or not 0 <= k < self.spec.slots:
            raise FrameError(f"slot {k!r} is not a slot of this {self.spec.slots}-slot ring")
        lo = k * self.spec.slot_bytes
        return memoryview(self._mapped())[lo: lo + (self.spec.slot_bytes if length is None else length)]

    def zero(self) -> None:
        m = self._mapped()
        step = 1 << 20
        zeros = bytes(min(step, self.spec.nbytes))
        for lo in range(0, self.spec.nbytes, step):
            m[lo: lo + min(step, self.spec.nbytes - lo)] = zeros[: min(step, self.spec.nbytes - lo)]

    def close(self, *, zero: bool = True) -> None:
        """Zero (by default), unmap and close. Idempotent."""
        self.bound = False
        if self._map is not None:
            if zero:
                self.zero()
            try:
                self._map.close()
            except BufferError:  # a slot view is still alive somewhere: unmapped when it is collected
                pass
            self._map = None
        if not self.closed:
            self.closed = True
            os.close(self._fd)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.spec
        return f"ShmRing(epoch={s.epoch}, slots={s.slots}, slot_bytes={s.slot_bytes}, closed={self.closed})"


class RingReceiver:
    """The device's side of one ring: turns a chunk notification into the chunk's header and sealed bytes.

    ``take`` checks what only the ring knows (the slot id, and that the chunk plus its tag fits the slot)
    and returns the header without ``slot`` and a view of the slot's ciphertext, which the caller hands to
    the same acceptance as a chunk that came in a socket frame (epoch, window, replay window, tag)."""

    __slots__ = ("ring", "taken")

    def __init__(self, ring: ShmRing) -> None:
        self.ring = ring
        self.taken = 0

    @property
    def epoch(self) -> int:
        return self.ring.spec.epoch

    def take(self, header: Any) -> tuple[dict[str, Any], memoryview]:
        if not isinstance(header, dict):
            raise FrameError("chunk notification header must be an object")
        if not self.ring.bound or self.ring.closed:
            raise StaleEpochError(f"the ring was released at the RETURN of epoch {self.ring.spec.epoch}")
        k: Any = header.get("slot")
        n: Any = header.get("n")
        spec = self.ring.spec
        if type(n) is not int or not 0 < n <= spec.slot_bytes - TAG_LEN:
            raise FrameError(f"chunk of {n!r} bytes does not fit a {spec.slot_bytes}-byte ring slot "
                             f"with its {TAG_LEN}-byte tag")
        view = self.ring.slot(k, n + TAG_LEN)  # FrameError for a bad slot id, StaleEpochError once closed
        self.taken += 1
        chunk = header.copy()  # the header as a chunk that came in a frame: without ``slot``
        del chunk["slot"]
        return chunk, view

    def close(self) -> None:
        self.ring.close(zero=True)


# --- descriptor passing on a Unix socket ------------------------------------------------------------
def send_frame_with_fd(sock: socket.socket, frame: bytes, fd: int) -> None:
    """Send one whole frame with ``fd`` attached to its first byte."""
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    buf = bytearray()
    space = socket.CMSG_SPACE(4 * 4)
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(n - len(buf), space)
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(raw[: len(raw) - len(raw) % arr.itemsize])
                fds.extend(arr)
        if not data:
            if not buf:
                return None
            raise FrameError(f"truncated frame: stream ended after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def recv_frame_with_fds(sock: socket.socket, *, max_payload: int = 1 << 16) -> tuple[Frame, list[int]] | None:
    """Read exactly one frame from a Unix socket with ``recvmsg``, collecting any descriptors passed with
    it (never reading past the frame, so no descriptor can be lost in a read-ahead buffer). ``None`` on a
    clean end of stream. The caller owns (and must close) the descriptors."""
    fds: list[int] = []
    try:
        prefix = _recv_exact(sock, PREFIX.size, fds)
        if prefix is None:
            return None
        kind, hlen, plen = _parse_prefix(prefix, max_payload)
        raw = _recv_exact(sock, hlen + plen, fds) if hlen + plen else b""
        if raw is None:
            raise FrameError("truncated frame: stream ended after the prefix")
        return Frame(kind, _parse_header(raw[:hlen]), raw[hlen:]), fds
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


__all__ = ["MAX_RING_BYTES", "MAX_SLOTS", "RingReceiver", "RingSpec", "ShmRing", "recv_frame_with_fds",
           "ring_supported", "send_frame_with_fd"]
