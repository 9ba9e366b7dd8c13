"""Batch AES-256-GCM on the device: one launch per kernel for a whole batch of chunks.

Seal: CTR (plaintext -> ciphertext) -> GHASH segments -> join levels -> tag (writes tags).
Open: GHASH segments -> join levels -> tag (compares, sets ``ok``) -> CTR only for chunks whose tag
verified, so plaintext of a forged chunk is never produced, let alone written.

Chunks live in flat byte buffers at 16-byte aligned offsets (the kernels read whole blocks as four
32-bit words). A :class:`BatchPlan` holds a batch's layout on the device, so repeated batches of the
same shape (every hand-off of a provisioning, every ring hop) upload only their nonces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from gputravel.core.gpucipher.backend import Backend, backend, patch_simulator_shared_arrays
from gputravel.core.gpucipher.reference import (
    aes_encrypt_block,
    expand_key_le,
    nibble_tables,
    power_table,
    te0_le,
)
from gputravel.core.protocol.errors import GpuCipherError

I64 = npt.NDArray[np.int64]
Ints = Sequence[int] | I64
NONCE_BYTES = 12
TAG_BYTES = 16
#: GCM's limit on one message: 2^39 - 256 bits (the 32-bit block counter must not wrap).
MAX_CHUNK_BYTES = (1 << 36) - 32


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """How work is cut into threads. Block counts per thread are powers of two (the GHASH joins use
    H^(2^j) only)."""

    threads: int  # threads per thread block
    max_blocks: int  # grid cap; grid-stride loops cover the rest
    ctr_blocks: int  # 16-byte AES blocks per CTR task (per thread per loop turn)
    ghash_blocks: int  # GHASH input blocks per level-0 segment
    join_fan: int  # partial sums joined per thread per join level


#: A real GPU: 256 threads, enough blocks to fill every SM several times over.
CUDA_SHAPE = LaunchShape(threads=256, max_blocks=16384, ctr_blocks=16, ghash_blocks=32, join_fan=32)
#: The simulator runs each thread as a Python thread and each ``syncthreads`` costs milliseconds:
#: one thread block of 32 threads (one lane per bank) loops over all the work.
SIM_SHAPE = LaunchShape(threads=32, max_blocks=1, ctr_blocks=4, ghash_blocks=8, join_fan=8)


def _ceil_div(a: I64, b: int) -> I64:
    return np.asarray(-(-a // b), dtype=np.int64)


def _cum(counts: I64) -> I64:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _check_aligned(name: str, offsets: I64) -> None:
    if len(offsets) and (np.any(offsets % 16) or np.any(offsets < 0)):
        raise GpuCipherError(f"{name} must be non-negative multiples of 16 bytes")


@functools.cache
def kernels() -> ModuleType:
    """The kernel module, imported after the backend is fixed (``backend()`` runs first)."""
    if backend() == "simulator":
        patch_simulator_shared_arrays()
    try:
        from gputravel.core.gpucipher import kernels as module
    except ImportError as exc:
        raise GpuCipherError(f"the GPU cipher needs numba-cuda (pip install 'gputravel[gpu]'): {exc}") from exc
    return module


@dataclass(slots=True)
class BatchPlan:
    """A batch's layout, on the device: where each chunk's input, output and AAD sit, and the
    cumulative work counts every kernel searches to find its chunk."""

    nchunks: int
    lengths: I64
    src_off: Any
    dst_off: Any
    nbytes: Any
    aad_off: Any
    aad_len: Any
    ctr_cum: Any
    seg_cum: Any
    join_cums: list[Any]
    work: dict[str, int]


class GpuAesGcm:
    """AES-256-GCM with a fixed key on the device, byte-compatible with ``cryptography``'s AESGCM
    (96-bit nonces, 16-byte tags). The key schedule and the GHASH tables are built once, here."""

    def __init__(self, key: bytes, *, shape: LaunchShape | None = None) -> None:
        key = bytes(key)
        if len(key) != 32:
            raise GpuCipherError(f"AES-256-GCM needs a 32-byte key, got {len(key)} bytes")
        self.backend: Backend = backend()
        self._k = kernels()
        self.cuda: Any = self._k.cuda
        self.shape = shape or (CUDA_SHAPE if self.backend == "cuda" else SIM_SHAPE)
        for name in ("ghash_blocks", "join_fan"):
            v = getattr(self.shape, name)
            if v < 2 or v & (v - 1):
                raise GpuCipherError(f"LaunchShape.{name} must be a power of two >= 2, got {v}")
        rk = expand_key_le(key)
        h = int.from_bytes(aes_encrypt_block(rk, bytes(16)), "big")
        self._te = self.cuda.to_device(te0_le())
        self._rk = self.cuda.to_device(rk)
        self._htab = self.cuda.to_device(nibble_tables(h))
        self._pows = self.cuda.to_device(power_table(h))
        self._seg_log2 = self.shape.ghash_blocks.bit_length() - 1
        self._fan_log2 = self.shape.join_fan.bit_length() - 1

    # --- layout ---------------------------------------------------------------------------------
    def plan(self, lengths: Ints, *, src_offsets: Ints, dst_offsets: Ints, aad_lengths: Ints,
             aad_offsets: Ints) -> BatchPlan:
        """Upload a batch's layout (byte offsets must be multiples of 16)."""
        n = len(lengths)
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1)
                  for a in (lengths, src_offsets, dst_offsets, aad_lengths, aad_offsets)]
        if any(len(a) != n for a in arrays):
            raise GpuCipherError("lengths, offsets and AAD lengths must have one entry per chunk")
        ln, so, do, al, ao = arrays
        if n and (np.any(ln < 0) or np.any(ln > MAX_CHUNK_BYTES) or np.any(al < 0)):
            raise GpuCipherError(f"chunk lengths must lie in [0, {MAX_CHUNK_BYTES}] and AAD lengths be >= 0")
        for name, off in (("source offsets", so), ("destination offsets", do), ("AAD offsets", ao)):
            _check_aligned(name, off)
        s = self.shape
        ctr_cum = _cum(_ceil_div(_ceil_div(ln, 16), s.ctr_blocks))
        segs = _ceil_div(_ceil_div(al, 16) + _ceil_div(ln, 16) + 1, s.ghash_blocks)
        seg_cum = _cum(segs)
        cums = []
        while n and int(segs.max()) > 1:
            segs = _ceil_div(segs, s.join_fan)
            cums.append(_cum(segs))
        up = self.cuda.to_device
        return BatchPlan(nchunks=n, lengths=ln, src_off=up(so), dst_off=up(do), nbytes=up(ln), aad_off=up(ao),
                         aad_len=up(al), ctr_cum=up(ctr_cum), seg_cum=up(seg_cum),
                         join_cums=[up(c) for c in cums],
                         work={"ctr": int(ctr_cum[-1]), "seg": int(seg_cum[-1]),
                               **{f"join{i}": int(c[-1]) for i, c in enumerate(cums)}})

    # --- device-level runs ----------------------------------------------------------------------
    def nonce_words(self, nonces: Sequence[bytes]) -> Any:
        """Nonces as a device array of 3 little-endian words each (96-bit nonces only)."""
        raw = b"".join(bytes(x) for x in nonces)
        if any(len(x) != NONCE_BYTES for x in nonces):
            raise GpuCipherError("every nonce must be 12 bytes (96 bits): the GPU cipher implements no other size")
        return self.cuda.to_device(np.frombuffer(raw or bytes(12), dtype="<u4").astype(np.uint32))

    def seal_device(self, plan: BatchPlan, nonces: Any, src: Any, dst: Any, aad: Any, tags: Any) -> None:
        """Seal ``src`` into ``dst`` (may be the same buffer) and write 4 tag words per chunk into ``tags``."""
        if plan.nchunks == 0:
            return
        ok = self.cuda.to_device(np.ones(plan.nchunks, dtype=np.uint8))
        self._ctr(plan, nonces, src, dst, ok)
        self._tag(plan, nonces, aad, dst, tags, ok, verify=False)

    def open_device(self, plan: BatchPlan, nonces: Any, src: Any, dst: Any, aad: Any, tags: Any) -> Any:
        """Verify every chunk's tag, then decrypt only the verified chunks of ``src`` into ``dst``.
        Returns the device array of per-chunk flags (1 = verified and written)."""
        ok = self.cuda.to_device(np.zeros(max(plan.nchunks, 1), dtype=np.uint8))
        if plan.nchunks == 0:
            return ok
        self._tag(plan, nonces, aad, src, tags, ok, verify=True)
        self._ctr(plan, nonces, src, dst, ok)
        return ok

    def open_add_f32_device(self, plan: BatchPlan, nonces: Any, src: Any, dst_f32: Any, aad: Any, tags: Any) -> Any:
        """Verify every chunk's tag, then add the plaintext of each verified chunk (float32 words) into the
        float32 device array ``dst_f32`` at element ``dst_off / 4``, in one pass (``fused``): the plaintext is
        never written to memory. Chunk lengths must be multiples of 4. Returns the per-chunk flags."""
        if plan.nchunks and np.any(plan.lengths % 4):
            raise GpuCipherError("open-and-add works on float32 words: chunk lengths must be multiples of 4")
        ok = self.cuda.to_device(np.zeros(max(plan.nchunks, 1), dtype=np.uint8))
        if plan.nchunks == 0:
            return ok
        from gputravel.core.gpucipher import fused

        self._tag(plan, nonces, aad, src, tags, ok, verify=True)
        if plan.work["ctr"]:
            fused.ctr_add_f32_kernel[self._grid(plan.work["ctr"])](
                self._te, self._rk, nonces, _u32(src), plan.src_off, dst_f32, plan.dst_off, plan.nbytes,
                plan.ctr_cum, plan.nchunks, self.shape.ctr_blocks, ok)
        return ok

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def _grid(self, work: int) -> tuple[int, int]:
        t = self.shape.threads
        return max(1, min(self.shape.max_blocks, -(-work // t))), t

    def _ctr(self, plan: BatchPlan, nonces: Any, src: Any, dst: Any, ok: Any) -> None:
        if plan.work["ctr"] == 0:
            return
        grid = self._grid(plan.work["ctr"])
        self._k.ctr_kernel[grid](self._te, self._rk, nonces, _u32(src), _u8(src), _u32(dst), _u8(dst),
                                 plan.src_off, plan.dst_off, plan.nbytes, plan.ctr_cum, plan.nchunks,
                                 self.shape.ctr_blocks, ok)

    def _tag(self, plan: BatchPlan, nonces: Any, aad: Any, ct: Any, tags: Any, ok: Any, *, verify: bool) -> None:
        s = self.shape
        partial = self.cuda.device_array(4 * plan.work["seg"], dtype=np.uint32)
        self._k.ghash_segments_kernel[self._grid(plan.work["seg"])](
            self._htab, _u32(aad), _u8(aad), plan.aad_off, plan.aad_len, _u32(ct), _u8(ct), plan.src_off if verify
            else plan.dst_off, plan.nbytes, plan.seg_cum, plan.nchunks, s.ghash_blocks, partial)
        src_cum = plan.seg_cum
        for level, dst_cum in enumerate(plan.join_cums):
            work = plan.work[f"join{level}"]
            joined = self.cuda.device_array(4 * work, dtype=np.uint32)
            self._k.ghash_join_kernel[self._grid(work)](self._pows, self._seg_log2 + level * self._fan_log2,
                                                        partial, src_cum, dst_cum, plan.nchunks, s.join_fan,
                                                        joined)
            partial, src_cum = joined, dst_cum
        self._k.tag_kernel[self._grid(plan.nchunks)](self._te, self._rk, nonces, partial, plan.nchunks, tags,
                                                     1 if verify else 0, ok)

    # --- host-level batches ---------------------------------------------------------------------
    def seal(self, nonces: Sequence[bytes], plaintexts: Sequence[bytes], aads: Sequence[bytes]) \
            -> tuple[list[bytes], list[bytes]]:
        """Ciphertexts and 16-byte tags: ``ct + tag`` equals ``AESGCM(key).encrypt(nonce, pt, aad)``."""
        _same_count(nonces, plaintexts, aads)
        words = self.nonce_words(nonces)
        data, off, ln = _pack(plaintexts)
        abuf, aoff, aln = _pack(aads)
        plan = self.plan(ln, src_offsets=off, dst_offsets=off, aad_lengths=aln, aad_offsets=aoff)
        d = self.cuda.to_device(data)
        tags = self.cuda.device_array(max(4 * len(ln), 4), dtype=np.uint32)
        self.seal_device(plan, words, d, d, self.cuda.to_device(abuf), tags)
        host = d.copy_to_host()
        tag_host = tags.copy_to_host()
        return ([host[o:o + n].tobytes() for o, n in zip(off.tolist(), ln.tolist(), strict=True)],
                [tag_host[4 * i:4 * i + 4].astype("<u4").tobytes() for i in range(len(ln))])

    def open(self, nonces: Sequence[bytes], ciphertexts: Sequence[bytes], tags: Sequence[bytes],
             aads: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
        """Verify then decrypt each chunk into ``out[i]`` (a writable buffer of the ciphertext's length).
        A chunk whose tag does not verify leaves its ``out[i]`` untouched."""
        _same_count(nonces, ciphertexts, tags, aads, out)
        if any(len(t) != TAG_BYTES for t in tags):
            raise GpuCipherError("every tag must be 16 bytes")
        views = [memoryview(o).cast("B") for o in out]
        for v, c in zip(views, ciphertexts, strict=True):
            if v.readonly or v.nbytes != len(c):
                raise GpuCipherError("each output must be a writable buffer exactly as long as its ciphertext")
        words = self.nonce_words(nonces)
        data, off, ln = _pack(ciphertexts)
        abuf, aoff, aln = _pack(aads)
        plan = self.plan(ln, src_offsets=off, dst_offsets=off, aad_lengths=aln, aad_offsets=aoff)
        tag_words = np.frombuffer(b"".join(bytes(t) for t in tags) or bytes(16), dtype="<u4").astype(np.uint32)
        d = self.cuda.to_device(data)
        ok = self.open_device(plan, words, d, d, self.cuda.to_device(abuf), self.cuda.to_device(tag_words))
        flags = ok.copy_to_host()[: len(ln)].astype(bool).tolist()
        if any(flags):
            host = d.copy_to_host()
            for i, (o, n) in enumerate(zip(off.tolist(), ln.tolist(), strict=True)):
                if flags[i]:
                    views[i][:] = host[o:o + n].data
        return [bool(f) for f in flags]


def _same_count(*seqs: Sequence[Any]) -> None:
    if len({len(s) for s in seqs}) != 1:
        raise GpuCipherError("nonces, messages, tags, AADs and outputs must have one entry per chunk")


def _pack(parts: Sequence[bytes]) -> tuple[npt.NDArray[np.uint8], I64, I64]:
    """Chunks copied into one buffer at 16-byte aligned offsets (at least 16 bytes long)."""
    lengths = np.array([memoryview(p).nbytes for p in parts], dtype=np.int64)
    padded = (lengths + 15) // 16 * 16
    offsets = np.zeros(len(parts), dtype=np.int64)
    if len(parts):
        offsets[1:] = np.cumsum(padded)[:-1]
    buf = np.zeros(max(16, int(padded.sum())), dtype=np.uint8)
    for p, o, n in zip(parts, offsets.tolist(), lengths.tolist(), strict=True):
        buf[o:o + n] = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)
    return buf, offsets, lengths


def _u8(buf: Any) -> Any:
    return buf


def _u32(buf: Any) -> Any:
    """The 32-bit word view of a byte buffer's 4-byte aligned prefix (whole blocks only)."""
    n = buf.shape[0] - buf.shape[0] % 4
    if n == 0:
        raise GpuCipherError("device buffers must hold at least 4 bytes")
    return buf[:n].view(np.uint32)


def seal_batch(key: bytes, nonces: Sequence[bytes], plaintexts: Sequence[bytes], aads: Sequence[bytes]) \
        -> tuple[list[bytes], list[bytes]]:
    """Seal a batch on the device (key schedule once per batch): ``(ciphertexts, tags)``."""
    return GpuAesGcm(key).seal(nonces, plaintexts, aads)


def open_batch(key: bytes, nonces: Sequence[bytes], ciphertexts: Sequence[bytes], tags: Sequence[bytes],
               aads: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
    """Open a batch on the device: tags first, plaintext only into the ``out`` of verified chunks."""
    return GpuAesGcm(key).open(nonces, ciphertexts, tags, aads, out)

