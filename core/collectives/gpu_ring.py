"""``secure_gpu``: the secure ring all-reduce with every hop sealed and opened by the GPU cipher.

Where the ring's tensor lives on a GPU (NCCL), the CPU variants copy it to pinned host memory, seal
and open there with ``cryptography`` and copy back. This variant keeps everything on the device:
per ring step the outgoing segment is sealed by ``core.gpucipher``'s kernels into a device send
buffer (ciphertext, then the tag, written by the kernel), NCCL carries the ciphertext, and the
receiver verifies the tag, then, in reduce-scatter on float32 tensors, decrypts and adds into its
segment in one kernel pass (``gpucipher.fused``: the hop's plaintext never lands in memory); other
dtypes and the all-gather decrypt into a device scratch buffer, then add or copy it into the segment.
No plaintext and no ciphertext crosses PCIe.

The schedule, the AAD (``HopAad``: iteration, phase, step, chunk, src, dst, offset, length), the link
keys and their nonce counters are the CPU secure ring's (``ring``): one chunk per segment, as
``secure_naive``. The verdicts stay on the device until the end of the call (one synchronisation
per call, not per hop): a chunk that fails is neither decrypted nor written, its scratch stays zero,
and the call's closing agreement (``SecureRing._agree``) zeroes the result on every rank and raises
``TagError`` on the rank that rejected it.

A fused float32 add is the same IEEE single-precision addition torch does, so the result is bit for bit
the CPU secure ring's. On gloo (CPU tests) the kernels run in numba's CUDA simulator on CPU tensors:
slow, so only for tiny tensors.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from gputravel.core.collectives.crypto import TAG_LEN, HopAad, Phase, _HopState
from gputravel.core.collectives.keys import RingKeys
from gputravel.core.collectives.parts import RingPlan, RingStats, RingView
from gputravel.core.gpucipher.backend import gpu_cipher_on_cuda
from gputravel.core.protocol import TagError, nonce

__all__ = ["SIM_MAX_BYTES", "gpu_cipher_on_cuda", "gpu_secure_all_reduce"]

#: Largest tensor ``bench allreduce`` runs ``secure_gpu`` on when the GPU cipher is the simulator
#: (about 3 s per 64 KiB sealed there); larger sizes are skipped with a note.
SIM_MAX_BYTES = 64 * 1024


@functools.lru_cache(maxsize=16)
def _engine(key: bytes) -> Any:
    from gputravel.core.gpucipher import GpuAesGcm

    return GpuAesGcm(key)


def _pad(n: int) -> int:
    return (n + 15) // 16 * 16


def _needs_fences(t: torch.Tensor) -> bool:
    """Whether torch's work and the kernels' must be ordered by hand: the kernels run on numba's default
    stream, which orders with torch's only when torch also runs on the (legacy) default stream and numba
    has no per-thread default stream. DDP may call a comm hook on a side stream."""
    if not t.is_cuda:
        return False
    from numba.core import config as numba_config  # type: ignore[import-untyped,unused-ignore]

    per_thread = bool(getattr(numba_config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0))
    return per_thread or torch.cuda.current_stream(t.device) != torch.cuda.default_stream(t.device)


def _fence(on: bool, eng: Any, t: torch.Tensor, *, after: str) -> None:
    """Wait for the side that wrote (``torch`` or ``kernels``) before the other side reads."""
    if not on:
        return
    if after == "torch":
        torch.cuda.current_stream(t.device).synchronize()
    else:
        eng.synchronize()


class _Hop:
    """Seal or open one hop's chunk on the device, buffers laid out as ``ciphertext | pad | tag``."""

    def __init__(self, state: _HopState, flat: torch.Tensor) -> None:
        from gputravel.core.gpucipher.torch_io import device_bytes

        self.state = state
        self.eng = _engine(state.key.key)
        self.dev = device_bytes
        self.flat = flat

    def _common(self, seq: int, aad: HopAad, n: int) -> tuple[Any, Any, Any]:
        from gputravel.core.gpucipher.engine import _pack

        eng = self.eng
        abuf, aoff, aln = _pack([aad.pack()])
        plan = eng.plan([n], src_offsets=[0], dst_offsets=[0], aad_lengths=aln, aad_offsets=aoff)
        return plan, eng.nonce_words([nonce(self.state.prefix, seq)]), eng.cuda.to_device(abuf)

    def seal(self, seq: int, aad: HopAad, plain: torch.Tensor, out: torch.Tensor, *, fence: bool) -> None:
        """Seal ``plain`` (uint8, on the device) into ``out[:n]`` and its tag into ``out[pad(n):pad(n)+16]``."""
        n = plain.numel()
        out[:n].copy_(plain)  # device to device: the segment may not start on a 16-byte boundary
        _fence(fence, self.eng, out, after="torch")
        plan, words, aad_dev = self._common(seq, aad, n)
        buf = self.dev(self.eng, out, writable=True)
        tags = self.dev(self.eng, out[_pad(n): _pad(n) + TAG_LEN], writable=True).view(np.uint32)
        self.eng.seal_device(plan, words, buf, buf, aad_dev, tags)

    def open(self, seq: int, aad: HopAad, msg: torch.Tensor, n: int, scratch: torch.Tensor) -> Any:
        """Verify ``msg``'s tag, then decrypt into ``scratch[:n]`` only if it verified; the device flag."""
        plan, words, aad_dev = self._common(seq, aad, n)
        tags = self.dev(self.eng, msg[_pad(n): _pad(n) + TAG_LEN]).view(np.uint32)
        return self.eng.open_device(plan, words, self.dev(self.eng, msg), self.dev(self.eng, scratch, writable=True),
                                    aad_dev, tags)

    def open_add(self, seq: int, aad: HopAad, msg: torch.Tensor, segment: torch.Tensor) -> Any:
        """Verify ``msg``'s tag, then add its plaintext into the float32 ``segment`` in the same pass as the
        decryption (``gpucipher.fused``): the hop's plaintext never lands in memory. The device flag."""
        n = segment.numel() * 4
        plan, words, aad_dev = self._common(seq, aad, n)
        tags = self.dev(self.eng, msg[_pad(n): _pad(n) + TAG_LEN]).view(np.uint32)
        if self.eng.backend == "cuda":
            dst = self.eng.cuda.as_cuda_array(segment)  # float32 words: 4-byte alignment is enough
        else:  # the simulator's device array over the CPU tensor's memory (as torch_io.device_bytes does)
            dst = type(self.eng.cuda.to_device(np.zeros(1, dtype=np.float32)))(segment.numpy())
        return self.eng.open_add_f32_device(plan, words, self.dev(self.eng, msg), dst, aad_dev, tags)


def gpu_secure_all_reduce(ring: RingView, flat: torch.Tensor, keys: RingKeys, stats: RingStats) -> TagError | None:
    """One ``secure_gpu`` all-reduce of ``flat`` (in place); the first hop this rank rejected, if any."""
    rank, world, wire = ring.rank, ring.world, ring.wire
    esize = flat.element_size()
    plan = RingPlan.make(world=world, numel=flat.numel(), esize=esize, chunk_bytes=None)
    steps, maxc = 2 * world - 2, plan.maxc
    # the same reservations as the CPU secure ring's call, so the variants can share one ring's keys
    send_base = keys.send.reserve(steps * maxc)
    recv_base = keys.recv.reserve(steps * maxc)
    keys.gather_seal.reserve(maxc)
    for gather_opener in keys.gather_open:
        gather_opener.reserve(maxc)
    left, right = (rank - 1) % world, (rank + 1) % world
    b = plan.seg_bounds
    biggest = max(b[i + 1] - b[i] for i in range(world)) * esize
    size = _pad(max(1, biggest)) + TAG_LEN
    dev = flat.device
    send = torch.zeros(size, dtype=torch.uint8, device=dev)
    recv = torch.zeros(size, dtype=torch.uint8, device=dev)
    scratch = torch.zeros(_pad(max(1, biggest)), dtype=torch.uint8, device=dev)
    flat_bytes = flat.view(torch.uint8)
    sealer, hop_in = _Hop(keys.send, flat), _Hop(keys.recv, flat)
    fences = _needs_fences(flat)
    _fence(fences, sealer.eng, flat, after="torch")
    verdicts: list[tuple[Any, HopAad]] = []
    for g in range(steps):
        phase, step = (Phase.REDUCE_SCATTER, g) if g < world - 1 else (Phase.ALL_GATHER, g - (world - 1))
        si, ri = plan.seg(g, rank, send=True), plan.seg(g, rank, send=False)
        ns, nr = (b[si + 1] - b[si]) * esize, (b[ri + 1] - b[ri]) * esize
        t0 = time.perf_counter()
        msg_out = None
        if ns:
            aad = HopAad(keys.send.session_id, keys.epoch, ring.iteration, phase, step, 0, rank, right,
                         b[si] * esize, ns)
            sealer.seal(send_base + g * maxc, aad, flat_bytes[b[si] * esize: b[si + 1] * esize], send,
                        fence=fences)
            _fence(fences, sealer.eng, flat, after="kernels")  # NCCL reads what the kernel wrote
            msg_out = _inject(ring, phase, step, send[: _pad(ns) + TAG_LEN])
            stats.bytes_sealed += ns
        t1 = time.perf_counter()
        msg_in = recv[: _pad(nr) + TAG_LEN] if nr else None
        sw, rw = wire.exchange(msg_out, msg_in, tag=g)
        for w in (sw, rw):
            if w is not None:
                w.wait()
        t2 = time.perf_counter()
        fused = g < world - 1 and flat.dtype == torch.float32  # open and add in one kernel pass
        if msg_in is not None:
            aad = HopAad(keys.recv.session_id, keys.epoch, ring.iteration, phase, step, 0, left, rank,
                         b[ri] * esize, nr)
            segment = flat[b[ri]: b[ri + 1]]
            seq = recv_base + g * maxc
            if not fused:
                scratch[:nr].zero_()
            _fence(fences, hop_in.eng, flat, after="torch")  # the received bytes (and the zeroed scratch)
            flag = hop_in.open_add(seq, aad, msg_in, segment) if fused else hop_in.open(seq, aad, msg_in, nr,
                                                                                         scratch)
            verdicts.append((flag, aad))
            stats.bytes_opened += nr
        t3 = time.perf_counter()
        if msg_in is not None:
            _fence(fences, hop_in.eng, flat, after="kernels")
            if not fused:
                got = scratch[:nr].view(flat.dtype)
                if g < world - 1:
                    segment.add_(got)
                else:
                    segment.copy_(got)
        t4 = time.perf_counter()
        stats.crypto_s += (t1 - t0) + (t3 - t2)
        stats.wire_s += t2 - t1
        stats.reduce_s += t4 - t3
    t0 = time.perf_counter()
    error: TagError | None = None
    for flag, aad in verdicts:  # one synchronisation per call: the flags come back at the end
        if not int(flag.copy_to_host()[0]) and error is None:
            error = TagError(f"ring hop rejected: rank {aad.dst} could not authenticate iteration {aad.iteration} "
                             f"phase {Phase(aad.phase).name} step {aad.step} chunk {aad.chunk} from rank {aad.src} "
                             "(GPU cipher)")
    stats.wait_s += time.perf_counter() - t0
    return error


def _inject(ring: RingView, phase: Phase, step: int, out: torch.Tensor) -> torch.Tensor:
    """Fault injection (tests): a tampering host flips one ciphertext byte of the chosen hop."""
    fault = ring.fault
    if fault is None or fault.rank != ring.rank or fault.kind != "flip" or (fault.phase, fault.step) != (phase, step):
        return out
    out = out.clone()
    out[0] ^= 0x01
    return out
