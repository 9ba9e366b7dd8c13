"""The checkpoint ring: sealed checkpoint chunks cross from the device to the orchestrator in shared memory.

A checkpoint of GPT-2 is 1.5 GB. Over the control socket each chunk was copied four times (sealed into a
buffer, into the socket, out of it, into the file) and each 4 MiB frame took dozens of context switches.
Here the orchestrator makes a ring of ``slots`` slots in an anonymous shared-memory file (``memfd``, 0600,
sealed against shrinking and growing, so neither side can cut the mapping from under the other) and
names it to the device by ``/proc/<pid>/fd/<n>`` (same host, same user: the emulated platform's case).
The device seals chunk ``i`` straight into slot ``i % slots`` (``encrypt_into``: the ciphertext is
written once, where the orchestrator reads it) and the orchestrator writes the slot to the file from
there: the same single copy a plain ``write`` makes.

Flow control is two counters at the head of the ring: ``produced`` (the device's: chunks published)
and ``consumed`` (the orchestrator's: chunks written and their slots free again), and an ``abort``
flag either side raises. Each slot starts with its chunk's record kind (0 data, 1 the end chunk) and
length. Neither side blocks the control link: the device seals on a thread of its own while the next
visit's operations go on, and the orchestrator drains on a thread of its own.

Nothing in the ring is trusted: a slot's kind and length are checked against the ring, and the chunks'
tags are bound by the device's ``tag_digest``, which comes over the sealed control channel when the
stream ends (``checkpoint_end``); the orchestrator publishes the file only when it matches the tags it
wrote. Standard library only (the orchestrator's side loads no torch).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputravel.core.protocol.errors import DataError, FrameError

__all__ = ["CheckpointRing", "RingAborted", "ring_supported"]

#: ring head: consumed (orchestrator), produced (device), abort flag; padded to one cache line
_HEAD = struct.Struct("<QQI")
_HEAD_BYTES = 64
_SLOT_HEAD = struct.Struct("<II")  # record kind, sealed length
_SLOT_PAD = 64
MAX_SLOTS = 16
MAX_RING_BYTES = 1 << 28
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def ring_supported() -> bool:
    """True where a ring can be made and named (Linux ``memfd_create`` with sealing and ``/proc``)."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and os.path.isdir("/proc/self/fd")


class RingAborted(DataError):
    """The other side gave up on the stream (it raised the ring's abort flag)."""


@dataclass(frozen=True, slots=True)
class RingShape:
    slots: int
    slot_bytes: int

    @property
    def stride(self) -> int:
        return _SLOT_PAD + self.slot_bytes

    @property
    def nbytes(self) -> int:
        return _HEAD_BYTES + self.slots * self.stride

    def check(self) -> RingShape:
        if type(self.slots) is not int or type(self.slot_bytes) is not int:
            raise FrameError("checkpoint ring slots and slot_bytes must be integers")
        if not 2 <= self.slots <= MAX_SLOTS or self.slot_bytes < 64 or self.nbytes > MAX_RING_BYTES:
            raise FrameError(f"checkpoint ring of {self.slots} x {self.slot_bytes} bytes is outside the limits")
        return self


class CheckpointRing:
    """One side's mapping of a ring: ``create`` on the orchestrator, ``attach`` on the device."""

    def __init__(self, fd: int, shape: RingShape, *, path: str) -> None:
        self.shape = shape
        self.path = path
        self._fd = fd
        # pages come as the slots are first written (no MAP_POPULATE): a small state touches only what it uses
        self._map: mmap.mmap | None = mmap.mmap(fd, shape.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)

    @classmethod
    def create(cls, *, slots: int, slot_bytes: int) -> CheckpointRing:
        """A new zeroed ring, 0600, sealed against resizing, named by this process's ``/proc`` entry."""
        shape = RingShape(slots, slot_bytes).check()
        fd = os.memfd_create("gputravel-ckpt-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, shape.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, shape, path=f"/proc/{os.getpid()}/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, spec: Any) -> CheckpointRing:
        """Map the ring ``spec`` (``{"path", "slots", "slot_bytes"}``) names; refuses (``FrameError``) anything
        but a sealed shared-memory file of exactly that size, private to this user."""
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
            raise FrameError("a checkpoint ring needs its path, slots and slot_bytes")
        shape = RingShape(spec.get("slots"), spec.get("slot_bytes")).check()  # type: ignore[arg-type]
        path = str(spec["path"])
        if not path.startswith("/proc/") or "/fd/" not in path:
            raise FrameError(f"checkpoint ring path {path!r} is not a /proc/<pid>/fd/<n> entry")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise FrameError(f"cannot open the checkpoint ring {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != shape.nbytes or st.st_uid != os.getuid():
                raise FrameError(f"checkpoint ring {path} is not a {shape.nbytes}-byte file of this user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise FrameError(f"checkpoint ring {path} lets others in (mode {stat.S_IMODE(st.st_mode):o})")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & _SEALS != _SEALS:
                raise FrameError(f"checkpoint ring {path} is not sealed against resizing")
            return cls(fd, shape, path=path)
        except BaseException:
            os.close(fd)
            raise

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "slots": self.shape.slots, "slot_bytes": self.shape.slot_bytes}

    # --- the head ------------------------------------------------------------------------------------
    def _head(self) -> tuple[int, int, int]:
        if self._map is None:
            raise RingAborted("the checkpoint ring is closed")
        consumed, produced, abort = _HEAD.unpack_from(self._map, 0)
        return int(consumed), int(produced), int(abort)

    def abort(self) -> None:
        """Tell the other side to stop (idempotent)."""
        if self._map is not None:
            struct.pack_into("<I", self._map, 16, 1)

    def _wait(self, ready: Callable[[int, int], bool], what: str, timeout: float,
              alive: Callable[[], bool] | None = None) -> None:
        """Poll the head until ``ready(consumed, produced)``: sleeps from 50 us up to 0.5 ms between looks, so a
        waiting side costs next to no CPU (the device may be training beside it)."""
        deadline = time.monotonic() + timeout
        pause = 50e-6
        while True:
            consumed, produced, abort = self._head()
            if abort:
                raise RingAborted(f"checkpoint ring: the other side gave up while waiting for {what}")
            if ready(consumed, produced):
                return
            if time.monotonic() > deadline:
                raise RingAborted(f"checkpoint ring: no progress for {timeout:.0f} s waiting for {what}")
            if alive is not None and pause >= 5e-4 and not alive():
                raise RingAborted(f"checkpoint ring: the other side is gone (waiting for {what})")
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)

    def _slot(self, i: int) -> int:
        return _HEAD_BYTES + (i % self.shape.slots) * self.shape.stride

    # --- the device: produce -----------------------------------------------------------------------------
    def put(self, i: int, kind: int, fill: Callable[[memoryview], int], *, timeout: float = 600.0) -> int:
        """Chunk ``i``: wait for its slot to be free, let ``fill(slot)`` write the sealed bytes (returns the
        length), publish it. Returns the length."""
        n = fill(self.slot(i, timeout=timeout))
        self.publish(i, kind, n)
        return n

    def slot(self, i: int, *, timeout: float = 600.0) -> memoryview:
        """Chunk ``i``'s slot (``slot_bytes``), once it is free: the device writes the sealed bytes there, then
        :meth:`publish`."""
        self._wait(lambda consumed, _p: i - consumed < self.shape.slots, f"slot of chunk {i}", timeout)
        lo = self._slot(i)
        return self._view[lo + _SLOT_PAD: lo + _SLOT_PAD + self.shape.slot_bytes]

    def publish(self, i: int, kind: int, n: int) -> None:
        """Chunk ``i`` (record ``kind``, ``n`` sealed bytes) is in its slot: the orchestrator may take it."""
        if not 0 <= n <= self.shape.slot_bytes:
            raise FrameError(f"checkpoint ring: chunk {i} of {n} bytes does not fit a slot")
        assert self._map is not None
        lo = self._slot(i)
        _SLOT_HEAD.pack_into(self._map, lo, kind, n)
        struct.pack_into("<Q", self._map, 8, i + 1)  # after the bytes: the orchestrator reads them only now

    # --- the orchestrator: consume ------------------------------------------------------------------------
    def get(self, i: int, *, timeout: float = 600.0, alive: Callable[[], bool] | None = None
            ) -> tuple[int, memoryview]:
        """Chunk ``i`` once the device published it: ``(kind, sealed view)``, valid until :meth:`done`.
        ``alive`` (checked while waiting) says whether the device still lives."""
        self._wait(lambda _c, produced: produced > i, f"chunk {i}", timeout, alive)
        lo = self._slot(i)
        assert self._map is not None
        kind, n = _SLOT_HEAD.unpack_from(self._map, lo)
        if kind not in (0, 1) or n > self.shape.slot_bytes:
            raise FrameError(f"checkpoint ring: chunk {i} has a bad slot (kind {kind}, {n} bytes)")
        return int(kind), self._view[lo + _SLOT_PAD: lo + _SLOT_PAD + n]

    def done(self, i: int) -> None:
        """Chunk ``i`` is written: its slot is free again."""
        assert self._map is not None
        struct.pack_into("<Q", self._map, 0, i + 1)

    def close(self) -> None:
        """Unmap and close (idempotent); the memory goes when both sides have closed it."""
        if self._map is not None:
            try:
                self._view.release()
                self._map.close()
            except BufferError:  # a slot view is still alive somewhere: unmapped when it is collected
                pass
            self._map = None
            os.close(self._fd)

    def __repr__(self) -> str:
        return f"CheckpointRing({self.shape.slots} x {self.shape.slot_bytes} bytes, open={self._map is not None})"
