"""Chunk openers: the one strategy that authenticates and decrypts provisioning chunks into the data buffer.

``ChunkOpener`` is the interface ``ChunkIntake.submit_chunk`` (core/device/intake.py) calls once a chunk
passed the window's checks; one opener is chosen per device service (:func:`choose_opener`), of two kinds:

- ``HostOpener`` (``cpu``): ``cryptography``'s AES-GCM ``decrypt_into`` on a host core, through the data
  plane (core/device/dataplane.py): straight into the buffer on a CPU device; into a pinned staging slot,
  then copied on the copy stream, on a CUDA device (so a chunk's plaintext passes through host memory on
  its way in). The data plane's workers, slots and completion thread are its machinery.
- ``GpuOpener`` (``gpu``): the ciphertext goes to the device as it is and ``core.gpucipher``'s kernels open
  it there, verifying every tag before they decrypt, writing only verified chunks into the window: a
  holder's plaintext never sits in host memory (what a CC-mode GPU's copy engine does). Chunks that arrive
  while a launch runs (the pipelined data path delivers several at once) are opened together in the next
  launch. On a CPU-only machine (forced ``gpu``) the same kernels run in numba's CUDA simulator on the CPU
  buffer: slow, for tests.

``auto`` picks ``gpu`` when the buffer is on CUDA and numba-cuda sees a CUDA device, else ``cpu``.
The replay, window and epoch checks happen in the intake before an opener is called; an opener only
answers "tag verified and written" or fails the chunk with :class:`TagError` having written nothing
(the host opener zeroes the destination, as ``RecvState.decrypt_into`` does).
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from gputravel.core.device.dataplane import DataPlane, DoneFn
from gputravel.core.errors import ConfigError, DeviceError
from gputravel.core.protocol import TAG_LEN, DirectionKey, FrameType, RecvState, TagError
from gputravel.core.protocol.cipher import nonce

EngineSetting = Literal["auto", "cpu", "gpu"]
ENGINE_SETTINGS: tuple[str, ...] = ("auto", "cpu", "gpu")
CPU_LABEL = "cpu (cryptography)"


class ChunkOpener(Protocol):
    """Opens one provisioning chunk (``ciphertext || tag``) into ``buffer[offset : offset + length]``."""

    kind: Literal["cpu", "gpu"]
    #: what reports show: "cpu (cryptography)", "gpu (cuda)" or "gpu (simulator)"
    label: str
    #: why this engine was chosen ("auto: ...", "set explicitly")
    reason: str

    def submit(self, recv: RecvState, key: DirectionKey | None, payload: Any, *, seq: int, offset: int,
               length: int, chunk_size: int, done: DoneFn) -> None:
        """Verify and decrypt into the buffer; ``done(None)`` once the plaintext is in device memory,
        ``done(error)`` if not (``TagError``: the window's bytes unwritten), exactly once, maybe on another
        thread. Returns once ``payload`` is no longer read. ``key`` is the window's (``recv`` holds it too);
        ``chunk_size`` the window's chunk size (what staging slots are sized for)."""
        ...

    def forget(self, fingerprint: str) -> None:
        """The key with this fingerprint is dead: drop anything derived from it."""
        ...

    def scrub(self) -> None:
        """Zero whatever the opener keeps between chunks (the buffer's scrub calls it)."""
        ...


class HostOpener:
    """The host CPU opens the chunk (``decrypt_into``, the GIL released) through the data plane: into the
    buffer itself on a CPU device, through a staging slot and the copy stream on a CUDA device."""

    kind: Literal["cpu", "gpu"] = "cpu"
    label = CPU_LABEL

    def __init__(self, plane: DataPlane, *, reason: str = "set explicitly") -> None:
        self.plane = plane
        self.reason = reason

    def submit(self, recv: RecvState, key: DirectionKey | None, payload: Any, *, seq: int, offset: int,
               length: int, chunk_size: int, done: DoneFn) -> None:
        self.plane.open(recv, payload, seq=seq, offset=offset, length=length, chunk_size=chunk_size, done=done)

    def forget(self, fingerprint: str) -> None:
        return None  # the key lives in the window's RecvState, which dies with the window

    def scrub(self) -> None:
        return None  # its staging slots are the data plane's (``DataPlane.scrub``: the service scrubs both)


@dataclass(slots=True)
class _Pending:
    """One chunk waiting for a launch, and its verdict once the launch ran."""

    key: DirectionKey
    nonce: bytes
    aad: bytes
    payload: Any
    offset: int
    length: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: BaseException | None = None


class GpuOpener:
    """AES-256-GCM open on the device (``core.gpucipher``), straight into the buffer's window.

    Concurrent callers (the pipelined data path's workers) are combined: whoever finds no launch
    running takes every chunk queued so far into one launch; chunks that arrive meanwhile go into the
    next. One key is live at a time (one window is open at a time); its GPU key schedule is built on
    the window's first chunk and dropped when the service buries the window."""

    kind: Literal["cpu", "gpu"] = "gpu"

    def __init__(self, buffer: torch.Tensor, *, reason: str = "set explicitly", max_batch: int = 64) -> None:
        from gputravel.core.gpucipher import backend

        self.backend = backend()
        self.label = f"gpu ({self.backend})"
        self.reason = reason
        self.buffer = buffer
        on_cuda = buffer.device.type == "cuda"
        if self.backend == "simulator" and on_cuda:
            raise ConfigError("the gpu cipher engine runs in numba's simulator here, which cannot write a CUDA "
                              "buffer: use --cipher-engine cpu, or a machine where numba-cuda sees the GPU")
        if self.backend == "cuda" and not on_cuda:
            raise ConfigError("the gpu cipher engine on a CUDA device needs the data buffer on CUDA (--device cuda)")
        self.max_batch = max(1, max_batch)
        self._lock = threading.Lock()  # guards the queue and the launch flag
        self._queue: list[_Pending] = []
        self._launching = False
        self._engine: Any = None
        self._engine_fp = ""
        self._stage: torch.Tensor | None = None  # device staging for ciphertext (cuda backend)
        self.launches = 0
        self.chunks = 0
        if self.backend == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernels now (numba compiles at a kernel's first launch, seconds per kernel), at the
        device's start rather than on a holder's first chunk. Zero key, nonce and data: nothing secret."""
        from gputravel.core.gpucipher import GpuAesGcm

        eng = GpuAesGcm(bytes(32))
        msg = bytes(64 * 1024)  # long enough for a GHASH join level
        cts, tags = eng.seal([bytes(12)], [msg], [b"warm-up"])
        out = bytearray(len(msg))
        if eng.open([bytes(12)], cts, tags, [b"warm-up"], [out]) != [True]:
            raise ConfigError("the GPU cipher failed its warm-up round trip on this device")

    # --- the strategy ---------------------------------------------------------------------------
    def submit(self, recv: RecvState, key: DirectionKey | None, payload: Any, *, seq: int, offset: int,
               length: int, chunk_size: int, done: DoneFn) -> None:
        """:meth:`open` on the calling thread (launches of concurrent callers combine), then ``done``."""
        try:
            if key is None:
                raise DeviceError(f"chunk {seq}: the GPU opener needs the window's key, and the window has none")
            self.open(recv, key, payload, seq=seq, offset=offset, length=length)
        except BaseException as exc:  # reported through done, exactly once
            done(exc)
        else:
            done(None)

    def open(self, recv: RecvState, key: DirectionKey, payload: Any, *, seq: int, offset: int, length: int) -> None:
        """Open one chunk into the buffer before returning, or raise ``TagError`` having written nothing."""
        if len(payload) != length + TAG_LEN:
            raise TagError(f"chunk {seq} is not {length} bytes of ciphertext and a tag")
        item = _Pending(key, nonce(recv.prefix, seq), recv.aad(seq, offset, length, FrameType.CHUNK), payload,
                        offset, length)
        with self._lock:
            self._queue.append(item)
            leader = not self._launching
            if leader:
                self._launching = True
        if leader:
            self._drain()
        item.done.wait()
        if item.error is not None:
            raise item.error
        if not item.ok:
            raise TagError(f"authentication failed for sequence {seq} (epoch {recv.epoch}): nothing written")

    def forget(self, fingerprint: str) -> None:
        with self._lock:
            if self._engine_fp == fingerprint:
                self._engine, self._engine_fp = None, ""

    # --- launches -------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Launch batches (chunks under one key each) until the queue is empty, then hand the leader
        role back."""
        while True:
            with self._lock:
                if not self._queue:
                    self._launching = False
                    return
                fp = self._queue[0].key.fingerprint
                n = 0
                while n < min(len(self._queue), self.max_batch) and self._queue[n].key.fingerprint == fp:
                    n += 1
                batch, self._queue = self._queue[:n], self._queue[n:]
            try:
                flags = self._launch(batch[0].key, batch)
                for item, ok in zip(batch, flags, strict=True):
                    item.ok = ok
            except BaseException as exc:  # handed to every waiter, re-raised there
                for item in batch:
                    item.error = exc
            finally:
                for item in batch:
                    item.done.set()

    def _engine_for(self, key: DirectionKey) -> Any:
        if self._engine is None or self._engine_fp != key.fingerprint:
            from gputravel.core.gpucipher import GpuAesGcm

            self._engine, self._engine_fp = GpuAesGcm(key.key), key.fingerprint
        return self._engine

    def _launch(self, key: DirectionKey, batch: list[_Pending]) -> list[bool]:
        from gputravel.core.gpucipher import open_into_tensor

        engine = self._engine_for(key)
        lengths = [p.length for p in batch]
        slots = [(n + 15) // 16 * 16 for n in lengths]
        ins = [sum(slots[:i]) for i in range(len(batch))]
        total = max(16, sum(slots))
        host = np.zeros(total, dtype=np.uint8)  # ciphertext only: what the wire carried
        for p, at in zip(batch, ins, strict=True):
            host[at: at + p.length] = np.frombuffer(memoryview(p.payload)[: p.length], dtype=np.uint8)
        tags = [bytes(memoryview(p.payload)[p.length: p.length + TAG_LEN]) for p in batch]
        aligned = all(p.offset % 16 == 0 for p in batch)
        if self.backend == "cuda":
            src = self._device_stage(total)
            src[:total].copy_(torch.from_numpy(host))  # host-to-device, ciphertext as it is
            torch.cuda.current_stream(self.buffer.device).synchronize()  # the kernels run on numba's stream
            src_view: Any = src[:total]
        else:
            src_view = host
        if aligned:
            flags: list[bool] = open_into_tensor(engine, [p.nonce for p in batch], src_view, tags,
                                                 [p.aad for p in batch], self.buffer, lengths=lengths,
                                                 in_offsets=ins, out_offsets=[p.offset for p in batch])
        else:
            # a window that does not start on a 16-byte boundary: open in place in the (device) staging
            # buffer, then copy device-to-device; the plaintext still never leaves the device
            flags = open_into_tensor(engine, [p.nonce for p in batch], src_view, tags, [p.aad for p in batch],
                                     src_view, lengths=lengths, in_offsets=ins, out_offsets=ins)
            stage_t = src_view if isinstance(src_view, torch.Tensor) else torch.from_numpy(src_view)
            for p, at, ok in zip(batch, ins, flags, strict=True):
                if ok:
                    self.buffer[p.offset: p.offset + p.length].copy_(stage_t[at: at + p.length])
            stage_t[:total].zero_()
        if self.backend == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        self.launches += 1
        self.chunks += len(batch)
        return flags

    def _device_stage(self, nbytes: int) -> torch.Tensor:
        if self._stage is None or self._stage.numel() < nbytes:
            self._stage = torch.empty(nbytes, dtype=torch.uint8, device=self.buffer.device)
        return self._stage

    def scrub(self) -> None:
        """Zero the device staging buffer (it only ever held ciphertext, or plaintext of unaligned windows)."""
        if self._stage is not None:
            self._stage.zero_()


def numba_cuda_available() -> bool:
    """True when numba-cuda is installed and the CUDA driver reports a device (imports nothing heavy)."""
    from gputravel.core.gpucipher.backend import cuda_device_present

    return importlib.util.find_spec("numba_cuda") is not None and cuda_device_present()


def choose_opener(setting: str, plane: DataPlane) -> ChunkOpener:
    """The opener for ``setting`` (``auto``, ``cpu`` or ``gpu``) and the data plane's buffer; see the module
    docstring."""
    if setting not in ENGINE_SETTINGS:
        raise ConfigError(f"cipher engine must be one of {', '.join(ENGINE_SETTINGS)}, not {setting!r}")
    buffer = plane.buffer
    if setting == "cpu":
        return HostOpener(plane)
    if setting == "gpu":
        return GpuOpener(buffer)
    if buffer.device.type != "cuda":
        return HostOpener(plane, reason="auto: the data buffer is in host memory (no CUDA device)")
    if not numba_cuda_available():
        return HostOpener(plane, reason="auto: numba-cuda or its CUDA device is not available")
    from gputravel.core.gpucipher import backend

    if backend() != "cuda":
        return HostOpener(plane, reason=f"auto: the GPU cipher runs on the {backend()} backend in this process")
    return GpuOpener(buffer, reason="auto: buffer on CUDA and numba-cuda sees the device")


def describe_choice(setting: str = "auto", *, device: str | None = None) -> tuple[str, str]:
    """``(label, reason)`` of the engine a device service would choose here, without building one
    (for ``attest`` and reports made before any device runs)."""
    if setting not in ENGINE_SETTINGS:
        raise ConfigError(f"cipher engine must be one of {', '.join(ENGINE_SETTINGS)}, not {setting!r}")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = dev.startswith("cuda")
    if setting == "cpu":
        return CPU_LABEL, "set explicitly"
    if setting == "gpu":
        gpu = on_cuda and numba_cuda_available()
        return ("gpu (cuda)" if gpu else "gpu (simulator)"), "set explicitly"
    if on_cuda and numba_cuda_available():
        return "gpu (cuda)", "auto: buffer on CUDA and numba-cuda sees the device"
    return CPU_LABEL, ("auto: the data buffer is in host memory (no CUDA device)" if not on_cuda
                       else "auto: numba-cuda or its CUDA device is not available")


__all__ = ["CPU_LABEL", "ENGINE_SETTINGS", "ChunkOpener", "EngineSetting", "GpuOpener", "HostOpener",
           "choose_opener", "describe_choice", "numba_cuda_available"]
