"""Tensors in, tensors out: seal and open chunks that already sit in device memory, without a copy.

For provisioning into CUDA (ciphertext copied host-to-device as is, opened by the GPU straight into the
data window) and for secure ring hops (seal a gradient slice on the GPU, open on receipt). On the
``cuda`` backend a CUDA tensor (or anything with ``__cuda_array_interface__``: CuPy, numba) is used in
place; on the ``simulator`` backend CPU tensors and NumPy arrays stand in for device memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gputravel.core.gpucipher.backend import GpuCipherError
from gputravel.core.gpucipher.engine import TAG_BYTES, GpuAesGcm, _pack


def device_bytes(engine: GpuAesGcm, obj: Any, *, writable: bool = False) -> Any:
    """A flat uint8 device view of a contiguous tensor or array, sharing its memory."""
    if type(obj).__module__.split(".")[0] == "torch":
        if not obj.is_contiguous():
            raise GpuCipherError("tensors given to the GPU cipher must be contiguous")
        if engine.backend == "cuda" and not obj.is_cuda:
            raise GpuCipherError("the cuda backend needs CUDA tensors (copy ciphertext host-to-device first)")
        if engine.backend == "simulator" and obj.is_cuda:
            raise GpuCipherError("the simulator backend works on CPU tensors")
        import torch

        flat = obj.reshape(-1).view(torch.uint8)
        obj = flat.numpy() if engine.backend == "simulator" else flat
    if engine.backend == "cuda":
        arr = engine.cuda.as_cuda_array(obj)  # zero-copy through __cuda_array_interface__
        if arr.__cuda_array_interface__["data"][0] % 16:
            raise GpuCipherError("device buffers must start on a 16-byte boundary")
    else:
        arr = np.asarray(obj)
        if writable and not arr.flags.writeable:
            raise GpuCipherError("the output buffer is read-only")
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = arr.reshape(-1).view(np.uint8)
    if engine.backend == "simulator":
        # the simulator copies plain arrays in and out around every launch (and the kernels see a
        # buffer through two views): wrap it as the simulator's device array, which shares memory
        fake_device_array = type(engine.cuda.to_device(np.zeros(4, dtype=np.uint8)))
        arr = fake_device_array(arr)
    return arr


def _engine(key_or_engine: bytes | GpuAesGcm) -> GpuAesGcm:
    return key_or_engine if isinstance(key_or_engine, GpuAesGcm) else GpuAesGcm(key_or_engine)


def _offsets(lengths: Sequence[int], offsets: Sequence[int] | None) -> list[int]:
    if offsets is not None:
        return list(offsets)
    out, pos = [], 0
    for n in lengths:  # back to back: every chunk but the last must then be a multiple of 16 bytes
        out.append(pos)
        pos += n
    return out


def open_into_tensor(key: bytes | GpuAesGcm, nonces: Sequence[bytes], ciphertext: Any, tags: Sequence[bytes],
                     aads: Sequence[bytes], out: Any, *, lengths: Sequence[int],
                     in_offsets: Sequence[int] | None = None, out_offsets: Sequence[int] | None = None) -> list[bool]:
    """Open chunks of a device buffer ``ciphertext`` into the device buffer ``out`` (e.g. a data window).

    Tags are verified first; a chunk whose tag fails is not decrypted and its bytes of ``out`` are left
    as they were. Offsets default to the chunks packed back to back; all must be multiples of 16."""
    eng = _engine(key)
    if not len(nonces) == len(tags) == len(aads) == len(lengths):
        raise GpuCipherError("nonces, tags, AADs and lengths must have one entry per chunk")
    if any(len(t) != TAG_BYTES for t in tags):
        raise GpuCipherError("every tag must be 16 bytes")
    src = device_bytes(eng, ciphertext)
    dst = device_bytes(eng, out, writable=True)
    ins, outs = _offsets(lengths, in_offsets), _offsets(lengths, out_offsets)
    _check_bounds(src, ins, lengths, "ciphertext")
    _check_bounds(dst, outs, lengths, "output")
    abuf, aoff, aln = _pack(aads)
    plan = eng.plan(lengths, src_offsets=ins, dst_offsets=outs, aad_lengths=aln, aad_offsets=aoff)
    tag_words = np.frombuffer(b"".join(bytes(t) for t in tags) or bytes(16), dtype="<u4").astype(np.uint32)
    ok = eng.open_device(plan, eng.nonce_words(nonces), src, dst, eng.cuda.to_device(abuf),
                         eng.cuda.to_device(tag_words))
    return [bool(f) for f in ok.copy_to_host()[: len(lengths)]]


def seal_from_tensor(key: bytes | GpuAesGcm, nonces: Sequence[bytes], plaintext: Any, aads: Sequence[bytes],
                     out: Any, *, lengths: Sequence[int], in_offsets: Sequence[int] | None = None,
                     out_offsets: Sequence[int] | None = None) -> list[bytes]:
    """Seal chunks of the device buffer ``plaintext`` into ``out`` (may be the same buffer); the tags."""
    eng = _engine(key)
    if not len(nonces) == len(aads) == len(lengths):
        raise GpuCipherError("nonces, AADs and lengths must have one entry per chunk")
    src = device_bytes(eng, plaintext)
    dst = device_bytes(eng, out, writable=True)
    ins, outs = _offsets(lengths, in_offsets), _offsets(lengths, out_offsets)
    _check_bounds(src, ins, lengths, "plaintext")
    _check_bounds(dst, outs, lengths, "output")
    abuf, aoff, aln = _pack(aads)
    plan = eng.plan(lengths, src_offsets=ins, dst_offsets=outs, aad_lengths=aln, aad_offsets=aoff)
    tags = eng.cuda.device_array(max(4 * len(lengths), 4), dtype=np.uint32)
    eng.seal_device(plan, eng.nonce_words(nonces), src, dst, eng.cuda.to_device(abuf), tags)
    host = tags.copy_to_host()
    return [host[4 * i:4 * i + 4].astype("<u4").tobytes() for i in range(len(lengths))]


def _check_bounds(buf: Any, offsets: Sequence[int], lengths: Sequence[int], name: str) -> None:
    size = int(buf.shape[0])
    if len(offsets) != len(lengths):
        raise GpuCipherError(f"{name} offsets must have one entry per chunk")
    for o, n in zip(offsets, lengths, strict=True):
        if o < 0 or n < 0 or o + n > size:
            raise GpuCipherError(f"{name} chunk [{o}, {o + n}) lies outside the {size}-byte buffer")
