"""The device service's windows part: the data buffer's provisioning windows (a key per window and epoch,
closed when the holder returns the GPU), the buffer's scrub, and its debug digest.

:class:`BufferWindows` is one part of :class:`~gputravel.core.device.service.DeviceService`: it owns the open
window, the epoch, the dead epochs and the tags of their chunks (to name a replay), and the condition a closing
window waits on for its chunks in flight; it adds ``handoff``, ``close_window``, ``window_status``, ``scrub`` and
``digest`` to the one operation table. The chunks themselves come in through the intake part
(:mod:`gputravel.core.device.intake`), which reads the window under ``lock``."""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputravel.core.device.counters import Counters
from gputravel.core.device.dataplane import DataPlane
from gputravel.core.device.memory import Region
from gputravel.core.device.openers import ChunkOpener
from gputravel.core.device.provision_window import ProvisionWindow
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.session_keys import DeviceSecrets
from gputravel.core.errors import DeviceError
from gputravel.core.protocol import (
    Direction,
    FrameType,
    RecvState,
    StaleEpochError,
    WindowError,
    encode_frame,
    provisioning_key,
)
from gputravel.core.protocol.deviceanswers import (
    BufferDigest,
    HandoffGrant,
    ScrubResult,
    WindowClosed,
    WindowStatus,
)
from gputravel.core.protocol.devicelink import Op
from gputravel.core.protocol.holderlink import ProvisioningKey

__all__ = ["ANSWER_WAIT_MAX_S", "DEAD_TAG_EPOCHS", "MAX_CHUNK", "BufferWindows", "ProvisionWindow"]

MAX_CHUNK = 16 * 1024 * 1024
#: closed windows whose accepted chunks' tags are remembered, so a captured chunk replayed later is named
DEAD_TAG_EPOCHS = 64
#: the longest a relayed window's request may be held for its window to complete (``when_complete``): the control
#: link is the device's one, and every other call waits behind the held request
ANSWER_WAIT_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class RelayFrame:
    """A checked HANDOFF to relay (``BufferWindows._relay_frame``): the holder whose parked connection gets it, the
    key fingerprint it names (a window's request relays it only for that window's key) and the encoded frame."""

    holder: str
    key_fp: object
    frame: bytes


class BufferWindows:
    """The buffer's windows and their operations: handoff, close_window, window_status, scrub, digest. Given at
    construction: the session part (``keys``, whose secrets derive each window's key), the buffer, the data
    plane and the opener (both hold per-window state the windows release), the counts, and the service's
    ``lock``."""

    def __init__(self, *, keys: DeviceSecrets, buffer: Region, plane: DataPlane, opener: ChunkOpener,
                 counts: Counters, lock: threading.Lock, allow_fault_injection: bool) -> None:
        self._keys, self._buffer, self._plane, self._opener, self._counts = keys, buffer, plane, opener, counts
        self._allow_fault_injection = allow_fault_injection
        self.lock = lock
        #: notified whenever a chunk leaves a window's in-flight set
        self.settled = threading.Condition(lock)
        #: notified only as the open window becomes complete (its last chunk in device memory) and as a data
        #: connection ends: a relayed window's request held for completion (``when_complete``) wakes once, not per chunk
        self.completed = threading.Condition(lock)
        self.window: ProvisionWindow | None = None
        #: the newest epoch a window was opened for (0 in a new session)
        self.epoch = 0
        self.dead_epochs: set[int] = set()
        self.dead_tags: dict[int, set[bytes]] = {}
        #: hand-offs so far: a key came into being with each (the model part measures afresh after one)
        self.keys_out = 0

    def new_session(self) -> None:
        """A new session (the service's lock held): every window, epoch and ring of the old one is forgotten."""
        self.epoch = 0
        self.window = None
        self._plane.release_rings()  # every ring of the old session is zeroed and released with its keys
        self.dead_epochs.clear()
        self.dead_tags.clear()

    def is_open(self) -> bool:
        """Whether a provisioning window is open (training, restore and scrub are refused while one is)."""
        return self.window is not None

    def operations(self) -> dict[str, Handler]:
        """This part's entries of the operation table."""
        return {Op.HANDOFF: self.op_handoff, Op.RELAY: self.op_relay, Op.CLOSE_WINDOW: self.op_close_window,
                Op.WINDOW_STATUS: self.op_window_status, Op.SCRUB: self.op_scrub, Op.DIGEST: self.op_digest}

    def op_handoff(self, *, epoch: int, offset: int, length: int, chunk_size: int, payload: bytes,
                   relay: dict[str, Any] | None = None, when_complete: float | None = None) -> Reply:
        """Derive the provisioning key for one window and one epoch; any earlier key dies. With ``relay``
        (``{holder, handoff}``: the window's HANDOFF, its key wrapped for that holder by the orchestrator, which
        derives the same key), the HANDOFF is written on the holder's parked data connection once the window is
        open, if it is of this window's epoch and key (``relayed`` in the grant; the holder link's copy is the
        fallback). A malformed ``relay`` is refused before anything changes.

        ``when_complete`` (seconds, at most ``ANSWER_WAIT_MAX_S``, only with ``relay``): a relayed HANDOFF's request
        is answered once the window is complete, grant and ``WindowClosed`` in one answer (``closed``); if the window
        is not complete within the bound, or its holder's data connection went, the grant comes with the open
        window's ``WindowStatus`` (``status``). A HANDOFF not relayed is answered at once, as without it."""
        s = self._keys.require()
        if when_complete is not None and (relay is None or type(when_complete) not in (int, float)
                                          or not 0 < when_complete <= ANSWER_WAIT_MAX_S):
            raise DeviceError(f"when_complete must be 0 < s <= {ANSWER_WAIT_MAX_S:g} with a relay, "
                              f"not {when_complete!r}")
        to = None
        if relay is not None:
            to = self._relay_frame(relay.get("holder"), epoch, relay.get("handoff")) if isinstance(relay, dict) \
                else None
            if to is None:
                raise DeviceError("relay needs a holder's name and a HANDOFF header")
        if epoch <= self.epoch or epoch in self.dead_epochs:
            raise StaleEpochError(f"epoch {epoch} is not newer than the current epoch {self.epoch}")
        if not (0 <= offset and 0 < length and offset + length <= self._buffer.nbytes):
            raise WindowError(f"window [{offset}, {offset + length}) is outside the {self._buffer.nbytes}-byte buffer")
        if not 0 < chunk_size <= MAX_CHUNK:
            raise DeviceError(f"chunk size {chunk_size} outside 1..{MAX_CHUNK}")
        key = provisioning_key(s.master, s.session_id, epoch=epoch, offset=offset, length=length,
                               direction=Direction.HOLDER_TO_DEVICE)
        with self.lock:
            if self.window is not None:
                self._bury(self.window)
            self.window = ProvisionWindow(epoch, offset, length, chunk_size, key.fingerprint,
                                          RecvState(key, session_id=s.session_id, window=4096), key=key)
            self.epoch = epoch
            self.keys_out += 1  # a key is out: the model's measurement after its return hashes afresh
        self._counts.counters["handoffs"] += 1
        relayed = False
        if to is not None:  # only a HANDOFF of this window's epoch and key
            relayed = to.key_fp == key.fingerprint and self._plane.admissions.relay(to.holder, to.frame)
            self._counts.counters["relayed" if relayed else "relay_missed"] += 1
        grant = HandoffGrant(session_id=s.session_id.hex(), key_fingerprint=key.fingerprint,
                             provisioning_key=ProvisioningKey.of(key), relayed=relayed).to_wire()
        if when_complete is None or not relayed or to is None:
            return Reply(grant)
        return self._answer_when_complete(grant, epoch, to.holder, float(when_complete))

    def _answer_when_complete(self, grant: dict[str, Any], epoch: int, holder: str, within: float) -> Reply:
        """``op_handoff``'s ``when_complete``: sleep on ``completed`` (notified as the window completes and as a data
        connection ends, never per chunk) until the window is complete, its holder's connection is gone, or
        ``within`` passes; then the grant with the closed window (its rings zeroed after the answer) or its status."""
        with self.lock:
            w = self.window
            done = w is not None and self.completed.wait_for(lambda: self._complete_or_gone(w, holder), timeout=within)
            complete = done and w is not None and self.window is w and len(w.accepted) == w.n_chunks
        if not complete:
            return Reply({**grant, "status": self.op_window_status(payload=b"").header})
        closed, after = self._close(epoch, defer=True)
        return Reply({**grant, "closed": closed}, after=after)

    def _complete_or_gone(self, w: ProvisionWindow, holder: str) -> bool:
        """The held request's wait is over (the lock held): ``w`` is no longer the open window, every chunk of it is
        in device memory, or no data connection of ``holder`` is left for it (neither admitted nor parked)."""
        if self.window is not w or (len(w.accepted) == w.n_chunks and not w.inflight):
            return True
        admissions = self._plane.admissions
        return admissions.connections(w.epoch) == 0 and admissions.parked(holder) == 0

    def op_relay(self, *, holder: str, epoch: int, handoff: dict[str, Any], payload: bytes) -> Reply:
        """Write the open window's HANDOFF on ``holder``'s parked data connection (``Admissions.relay``): the
        orchestrator wrapped its key for that holder (the device neither opens nor needs it). ``delivered``
        False where the holder has no parked connection or it is gone: the HANDOFF over the holder link is
        the way then. Only for the window open now, and never with a bare key."""
        to = self._relay_frame(holder, epoch, handoff)
        if to is None:
            raise DeviceError("relay needs a holder's name and a HANDOFF header")
        with self.lock:
            w = self.window
            if w is None or w.epoch != epoch:
                raise StaleEpochError(f"no open window for epoch {epoch} to relay a hand-off for")
        delivered = self._plane.admissions.relay(to.holder, to.frame)
        self._counts.counters["relayed" if delivered else "relay_missed"] += 1
        return Reply({"delivered": delivered})

    @staticmethod
    def _relay_frame(holder: object, epoch: int, handoff: object) -> RelayFrame | None:
        """The HANDOFF frame to relay for ``holder`` in ``epoch``; None without a holder's name and a header; a
        HANDOFF of another epoch, or whose key is not wrapped for its holder, is refused by name."""
        if not isinstance(holder, str) or not holder or not isinstance(handoff, dict):
            return None
        if handoff.get("epoch") != epoch:
            raise StaleEpochError(f"a HANDOFF of epoch {handoff.get('epoch')} is not relayed for epoch {epoch}")
        if "key" in handoff or "wrapped_key" not in handoff:
            raise DeviceError("only a HANDOFF whose key is wrapped for its holder is relayed")
        return RelayFrame(holder, handoff.get("key_fp"), encode_frame(FrameType.HANDOFF, handoff))

    def op_close_window(self, *, epoch: int, payload: bytes) -> Reply:
        """The holder returned the GPU: its key is dead from here on."""
        return Reply(self._close(epoch, defer=False)[0])

    def _close(self, epoch: int, *, defer: bool) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Close the window of ``epoch``: its ``WindowClosed`` (wire), and, ``defer``, its rings' zeroing and its
        connections' release to run once that is answered (the key is dead already: a chunk then is refused as of no
        open window); else done here (None)."""
        with self.lock:
            w = self.window
            if w is None or w.epoch != epoch:
                raise StaleEpochError(f"no open window for epoch {epoch}")
            self.window = None  # no new chunk is admitted from here on
            # chunks admitted before RETURN finish (their copies reach device memory) before the key dies
            self.settled.wait_for(lambda: not w.inflight, timeout=60)
            self._bury(w)
        self._plane.flush()  # the copy stream is idle: every acknowledged byte is in device memory
        # its rings zeroed and released, its data connections admitted for nothing
        after = functools.partial(self._plane.close_window, epoch)
        marks = dict(w.marks)
        if defer:  # answered at completion: when, for the hand-off's stages (``handoff.fixed_stages``)
            marks["answered"] = time.perf_counter_ns() - w.opened_ns
        else:
            after()
        return WindowClosed(epoch=epoch, bytes=w.bytes_in, chunks=len(w.accepted), expected_chunks=w.n_chunks,
                            contiguous=w.contiguous(), complete=len(w.accepted) == w.n_chunks,
                            rejected=dict(self._counts.rejected),
                            rejected_in_window=dict(self._counts.rejected_by_epoch.get(epoch, {})),
                            marks_ns=marks).to_wire(), after if defer else None

    def _bury(self, w: ProvisionWindow) -> None:
        """A window's key is dead; the tags of its chunks are kept a while to recognise replays."""
        self.dead_epochs.add(w.epoch)
        self._opener.forget(w.fingerprint)
        w.key = None
        self.dead_tags[w.epoch] = w.tags
        while len(self.dead_tags) > DEAD_TAG_EPOCHS:
            self.dead_tags.pop(next(iter(self.dead_tags)))

    def op_window_status(self, *, payload: bytes) -> Reply:
        w = self.window
        if w is None:
            return Reply(WindowStatus(open=False).to_wire())
        return Reply(WindowStatus(open=True, epoch=w.epoch, contiguous=w.contiguous(), chunks=len(w.accepted),
                                  bytes=w.bytes_in).to_wire())

    def op_scrub(self, *, payload: bytes) -> Reply:
        if self.window is not None:
            raise DeviceError("cannot scrub while a provisioning window is open")
        t0 = time.perf_counter()
        ok = self._buffer.zero_and_check()
        self._plane.scrub()  # the staging slots held plaintext on its way into device memory
        self._opener.scrub()
        self._counts.counters["scrubs"] += 1
        return Reply(ScrubResult(verified=ok, bytes=self._buffer.nbytes, seconds=time.perf_counter() - t0).to_wire())

    def op_digest(self, *, offset: int, length: int, payload: bytes) -> Reply:
        """Test/debug op (emulated platform, only with fault injection on): SHA-256 of the buffer
        bytes ``[offset, offset + length)``.

        It lets a test check, from outside the process, that refused chunks left the buffer as it
        was. A digest of plaintext is a confirmation oracle on the holders' data, so a production
        device (fault injection off) refuses it like ``op_tamper``.
        """
        if not self._allow_fault_injection:
            raise DeviceError("the digest op is a debug op: fault injection is disabled on this device")
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0 or offset + length > self._buffer.nbytes:
            raise WindowError(f"range [{offset}, {offset + length}) is outside the {self._buffer.nbytes}-byte buffer")
        with self.lock:
            data = self._buffer.tensor[offset: offset + length].cpu().numpy().tobytes()
        return Reply(BufferDigest(sha256=hashlib.sha256(data).hexdigest(), offset=offset, length=length).to_wire())
