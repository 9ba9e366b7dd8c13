"""The device's checkpoint and restore operations: its state out as sealed chunks, and back in.

Two ways out:

* **the ring** (``checkpoint {header, ring, snapshot}`` then ``checkpoint_end``): the device seals on a
  thread of its own straight into the orchestrator's shared-memory ring
  (:mod:`gputravel.core.protocol.ckptring`), while the control link serves the next visit. With
  ``snapshot`` it first copies its state in its own memory (device memory on a GPU), so training may go on
  at once; without it, it seals the live state, and an operation that would change the model (train,
  restore) waits until the stream is sealed. ``checkpoint_end`` waits for the thread and answers what was
  sealed (``StreamEnded``, with the seal's own time ``seal_s``: the device's seal alone).
* **attached chunks** (``checkpoint`` then ``checkpoint_next`` per chunk): each sealed chunk rides its
  control answer unencrypted again. For orchestrators that cannot map a ring (another host).

:class:`StateStreams` is one part of :class:`~gputravel.core.device.service.DeviceService`: it owns the open
streams (checkpoint, ring, restore) and the snapshot buffers, and adds ``checkpoint``, ``checkpoint_next``,
``checkpoint_end``, ``restore``, ``restore_chunk`` and ``restore_end`` to the one operation table. It reads and
writes the model through the model part (:class:`~gputravel.core.device.model.ModelSlot`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gputravel.core.device.counters import Counters
from gputravel.core.device.model import ModelSlot
from gputravel.core.device.reply import Handler, Reply
from gputravel.core.device.window import BufferWindows
from gputravel.core.errors import DeviceError, IntegrityError
from gputravel.core.procs import name_os_thread, run_in_background
from gputravel.core.protocol import FrameError
from gputravel.core.protocol.ckptring import CheckpointRing
from gputravel.core.protocol.deviceanswers import DeviceState, StreamEnded
from gputravel.core.protocol.devicelink import Op
from gputravel.core.protocol.stream import StreamHeader, StreamOpener, StreamSealer, rechunk
from gputravel.core.training.digest import DIGEST_FORMAT, check_digest_format, digest_trailer

__all__ = ["StateStreams"]


@dataclass(slots=True)
class _CheckpointStream:
    """An open checkpoint stream: its sealer, the state's bounded pieces still to seal, one reused output."""

    sealer: StreamSealer
    pieces: Iterator[memoryview]
    out: bytearray
    digest: str
    digest_s: float
    t0: float
    generation: tuple[int, int]  # the model generation it seals: a stream of a model changed since is refused


@dataclass(slots=True)
class _RestoreStream:
    opener: StreamOpener
    decoder: Any  # core.training.checkpoint.StateDecoder
    stage: bytearray
    t0: float
    weights: bool = False  # a pretrained model (kind "weights", --init-from), not a checkpoint


class _RingStream:
    """A checkpoint sealed by a thread of its own into the orchestrator's ring: the state's ``pieces`` (as
    ``state_pieces`` gives them, of any size) sealed chunk by chunk straight into the slots
    (``StreamSealer.seal_pieces``: no staging copy where a chunk spans tensors)."""

    def __init__(self, ring: CheckpointRing, sealer: StreamSealer, pieces: Iterator[memoryview], *, digest: str,
                 digest_s: float, snapshot_s: float, live: bool, state: Any) -> None:
        self.ring, self.sealer, self.pieces = ring, sealer, pieces
        self.digest, self.digest_s, self.snapshot_s, self.live = digest, digest_s, snapshot_s, live
        self.state = state  # the snapshot (or live state) the pieces view: kept alive until sealed
        self.seal_s = 0.0
        self.error: BaseException | None = None
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="checkpoint-seal", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        name_os_thread()
        run_in_background()  # below the training step and the MACs, which a visit waits for: on the cores they leave
        try:
            i = 0
            waited = 0.0

            def slot() -> memoryview:
                nonlocal waited
                t = time.thread_time()
                view = self.ring.slot(i)
                waited += time.thread_time() - t
                return view

            def publish(n: int) -> None:
                nonlocal i
                self.ring.publish(i, 0, n)
                i += 1

            # the seal's own time is this thread's CPU time (on a shared machine the wall clock also counts the
            # moments it waited for a core), not the waits for a free slot: the state's pieces (views, or
            # staged off a GPU) each encrypted where it lies straight into its chunk's slot
            t0 = time.thread_time()
            self.sealer.seal_pieces(self.pieces, slot, publish)
            self.seal_s += time.thread_time() - t0 - waited
            end = self.sealer.end(digest_trailer(self.digest))

            def fill_end(slot: memoryview) -> int:
                slot[: len(end)] = end
                return len(end)

            self.ring.put(i, 1, fill_end)
        except BaseException as exc:  # noqa: BLE001 - reported by checkpoint_end
            self.error = exc
            self.ring.abort()
        finally:
            self.seconds = time.perf_counter() - self.t0
            self.state = None
            self.pieces = iter(())

    def wait(self) -> None:
        self.thread.join()


class StateStreams:
    """The model state's streams out and in. Given at construction: the model part (the trainer, its digest and
    generation, whether it is whole), the windows part (no restore while a window is open), the torch device
    and the counts."""

    def __init__(self, *, model: ModelSlot, windows: BufferWindows, device: torch.device, counts: Counters) -> None:
        self._model, self._windows, self._device, self._counts = model, windows, device, counts
        self._ckpt_stream: _CheckpointStream | None = None
        self._restore_stream: _RestoreStream | None = None
        self._ring_stream: _RingStream | None = None
        self._snapshot_bufs: list[Any] = []  # a background checkpoint's copy of the state, reused

    def operations(self) -> dict[str, Handler]:
        """This part's entries of the operation table."""
        return {Op.CHECKPOINT: self.op_checkpoint, Op.CHECKPOINT_NEXT: self.op_checkpoint_next,
                Op.CHECKPOINT_END: self.op_checkpoint_end, Op.RESTORE: self.op_restore,
                Op.RESTORE_CHUNK: self.op_restore_chunk, Op.RESTORE_END: self.op_restore_end}

    @staticmethod
    def _stream_args(header: Any, payload: bytes, kinds: tuple[str, ...] = ("checkpoint",)
                     ) -> tuple[bytes, StreamHeader]:
        if len(payload) != 32:
            raise DeviceError(f"a checkpoint stream needs the run's 32-byte checkpoint key, got {len(payload)} bytes")
        if not isinstance(header, dict):
            raise FrameError("a checkpoint stream needs its header")
        hdr = StreamHeader.from_dict(header)
        if hdr.kind not in kinds:
            raise FrameError(f"a stream here has kind {' or '.join(map(repr, kinds))}, not {hdr.kind!r}")
        return bytes(payload), hdr

    def op_checkpoint(self, *, header: dict[str, Any], payload: bytes, ring: dict[str, Any] | None = None,
                      snapshot: bool = False) -> Reply:
        """Open a checkpoint stream under the run's checkpoint key (the payload) and ``header``: into the
        orchestrator's ``ring`` by a thread of its own (of a ``snapshot`` of the state, or the live state), or
        chunk by chunk with ``checkpoint_next``. The model digest (of this model generation, hashed at most
        once) rides sealed in the end chunk's trailer."""
        from gputravel.core.training.checkpoint import snapshot_state, state_pieces, state_size

        trainer = self._model.need_whole_model()
        key, hdr = self._stream_args(header, payload)
        rs = self._ring_stream
        if rs is not None:
            if rs.thread.is_alive():
                raise DeviceError("a checkpoint stream is still open: end it first (checkpoint_end)")
            rs.ring.close()  # one the orchestrator gave up on and never ended
            self._ring_stream = None
        digest = self._model.model_digest()
        digest_s = self._model.last_digest_s
        sealer = StreamSealer(key, hdr)
        state = trainer.state_dict()
        n_data = -(-state_size(state) // hdr.chunk_size)
        answer = {"chunk_size": hdr.chunk_size, "chunks": n_data + 1, "model_digest": digest, "digest_s": digest_s}
        self._counts.counters["checkpoints"] += 1
        if ring is not None:
            if hdr.sealed_size(hdr.chunk_size) > ring.get("slot_bytes", 0):
                raise FrameError("the checkpoint ring's slots are smaller than a sealed chunk")
            mapped = CheckpointRing.attach(ring)
            t0 = time.perf_counter()
            try:
                if snapshot:  # into the previous snapshot's buffers (kept: the device's staging memory)
                    state = snapshot_state(state, reuse=self._snapshot_bufs)
            except BaseException:
                mapped.close()
                raise
            snapshot_s = time.perf_counter() - t0
            self._ring_stream = _RingStream(mapped, sealer, state_pieces(state),
                                            digest=digest, digest_s=digest_s, snapshot_s=snapshot_s,
                                            live=not snapshot, state=state)
            self._model.read_live(self._ring_stream.wait if not snapshot else None)
            return Reply({**answer, "snapshot_s": snapshot_s})
        pieces = rechunk(state_pieces(state), hdr.chunk_size)
        self._ckpt_stream = _CheckpointStream(sealer, pieces, bytearray(hdr.sealed_size(hdr.chunk_size)), digest,
                                              digest_s, time.perf_counter(), self._model.generation)
        return Reply(answer)

    def op_checkpoint_end(self, *, payload: bytes) -> Reply:
        """Wait for the ring stream's thread; answer what it sealed (or why it stopped)."""
        rs = self._ring_stream
        if rs is None:
            raise DeviceError("no checkpoint stream is open in a ring")
        rs.wait()
        self._ring_stream = None
        self._model.read_live(None)
        rs.ring.close()
        if rs.error is not None:
            if isinstance(rs.error, (DeviceError, FrameError)) or hasattr(rs.error, "code"):
                raise rs.error
            raise DeviceError(f"the checkpoint's seal failed: {type(rs.error).__name__}: {rs.error}")
        self._counts.counters["bytes_out"] += rs.sealer.bytes
        done = StreamEnded(model_digest=rs.digest, tag_digest=rs.sealer.tag_digest, bytes=rs.sealer.bytes,
                           chunks=rs.sealer.index, seconds=rs.seconds, digest_s=rs.digest_s, seal_s=rs.seal_s,
                           snapshot_s=rs.snapshot_s)
        return Reply(done.to_wire())

    def op_checkpoint_next(self, *, payload: bytes) -> Reply:
        """The next sealed chunk of the open checkpoint stream (``kind`` 0), or its end chunk (``kind`` 1, ``done``)."""
        st = self._ckpt_stream
        if st is not None and st.generation != self._model.generation:
            st = self._ckpt_stream = None  # of a model that no longer exists
        if st is None:
            raise DeviceError("no checkpoint stream is open (none was begun, or the model changed since)")
        t = time.perf_counter()
        chunk = next(st.pieces, None)
        if chunk is not None:
            n = st.sealer.seal_into(chunk, st.out)
            self._counts.counters["bytes_out"] += n
            self._counts.counters["checkpoint_seal_ns"] += int((time.perf_counter() - t) * 1e9)
            return Reply({"kind": 0, "done": False}, memoryview(st.out)[:n], attached=True)
        sealed = st.sealer.end(digest_trailer(st.digest))
        self._ckpt_stream = None
        done = StreamEnded(model_digest=st.digest, tag_digest=st.sealer.tag_digest, bytes=st.sealer.bytes,
                           chunks=st.sealer.index, seconds=time.perf_counter() - st.t0, digest_s=st.digest_s,
                           seal_s=self._counts.counters.pop("checkpoint_seal_ns", 0) / 1e9)
        return Reply({"kind": 1, "done": True, **done.to_wire()}, sealed, attached=True)

    def op_restore(self, *, header: dict[str, Any], payload: bytes) -> Reply:
        """Open a restore stream: ``restore_chunk`` feeds the sealed chunks in order, each opened and written
        straight into the live model and optimizer tensors; ``restore_end`` checks the end chunk and the digest.
        A restore that fails part-way leaves the model incomplete: training and checkpoints are refused until a
        restore succeeds."""
        from gputravel.core.training.checkpoint import StateDecoder

        trainer = self._model.need_trainer()
        if self._windows.is_open():
            raise DeviceError("cannot restore while a provisioning window is open")
        key, hdr = self._stream_args(header, payload, ("checkpoint", "weights"))
        weights = hdr.kind == "weights"  # pretrained weights (--init-from): the model alone, before any step
        if weights and (trainer.step or trainer.optimizer.state):
            raise DeviceError("pretrained weights load only into a model that has not trained")
        self._model.settle()
        self._model.model_changed()
        trainer.frozen_hashes.forget()  # the decoder writes the tensors' memory, which torch does not count
        targets = {"model": trainer.model.state_dict()} if weights else trainer.state_dict()
        what = f"weights for {hdr.run_id}" if weights else f"checkpoint {hdr.seq} of {hdr.run_id}"
        self._restore_stream = _RestoreStream(StreamOpener(key, hdr, what=what),
                                              StateDecoder(targets=targets, device=self._device),
                                              bytearray(hdr.chunk_size), time.perf_counter(), weights)
        self._model.incomplete = True  # the live tensors are overwritten chunk by chunk until restore_end
        return Reply({"chunk_size": hdr.chunk_size})

    def _restore_failed(self) -> None:
        self._restore_stream = None
        self._model.incomplete = True
        self._model.model_changed()

    def op_restore_chunk(self, *, kind: int, payload: bytes) -> Reply:
        st = self._restore_stream
        if st is None:
            raise DeviceError("no restore stream is open")
        try:
            if kind == 0:
                n = st.opener.open_into(payload, st.stage)
                st.decoder.feed(memoryview(st.stage)[:n])
            elif kind == 1:
                st.opener.open(payload, final=True)
            else:
                raise FrameError(f"unknown stream chunk kind {kind!r}")
        except BaseException:
            self._restore_failed()
            raise
        self._counts.counters["bytes_in"] += len(payload)
        return Reply({"index": st.opener.index})

    def op_restore_end(self, *, payload: bytes) -> Reply:
        st = self._restore_stream
        if st is None:
            raise DeviceError("no restore stream is open")
        try:
            trailer = st.opener.finish()
            sealed_format = check_digest_format(trailer, st.opener.what)
            if st.weights:
                self._load_weights(st.decoder.result())
            else:
                self._model.need_trainer().load_state_dict(st.decoder.result())
        except BaseException:
            self._restore_failed()
            raise
        self._restore_stream = None
        self._model.incomplete = False
        self._model.model_changed()
        digest = self._model.model_digest()
        digest_s = self._model.last_digest_s
        # a stream sealed in an earlier format (v2) is checked in that format: the restored state hashed again
        # the way it was hashed when sealed; the model's digest from here on is the current format's
        t0 = time.perf_counter()
        sealed = digest if sealed_format == DIGEST_FORMAT else self._model.need_trainer().model_digest(sealed_format)
        digest_s += time.perf_counter() - t0 if sealed_format != DIGEST_FORMAT else 0.0
        if trailer.get("model_digest") != sealed:
            self._model.incomplete = True
            raise IntegrityError(f"{st.opener.what} restored to a model whose digest ({sealed_format}) {sealed[:16]} "
                                 f"differs from the sealed {str(trailer.get('model_digest'))[:16]}")
        self._counts.counters["restores"] += 1
        return Reply(DeviceState(model_digest=digest, digest_s=digest_s, sealed_digest=sealed,
                                 sealed_format=sealed_format).to_wire())

    def _load_weights(self, state: Any) -> None:
        """A ``weights`` stream's state: the model's parameters alone, of this model's shape."""
        trainer = self._model.need_trainer()
        if not isinstance(state, dict) or state.get("format") != "weights" or not isinstance(state.get("model"), dict):
            raise DeviceError("a weights stream holds {format: weights, config, model}")
        if state.get("config") != trainer.config.to_dict():
            raise DeviceError(f"weights of model {state.get('config')} differ from the program's {trainer.config.to_dict()}")
        trainer.load_base(state["model"])  # strict: every parameter (LoRA's adapters apart), nothing else
