"""The model's integrity MAC: AES-GMAC over the model's bytes, computed where the model lives.

VERIFY asks the device whether the model is still the one the orchestrator left there before a holder's key
was out. The model digest reads the whole state at hash speed (BLAKE3, ``v3``: about 4 GB/s a core on the build
machines; SHA-256, ``v2``, 0.2-0.35 GB/s); a GMAC runs at AES-GCM speed (about 5 GB/s a core there). The
orchestrator picks a fresh 32-byte key at each trusted point (where it has just checked the model
digest), the device MACs the model under it, and after the holder's return the device MACs again under the same
key: equal tags, same model. The key travels only inside the sealed control channel and is used for those two
MACs, so nobody who could alter the model can predict or forge a tag.

Layout (``v1``): the state's tensors in :meth:`Trainer.model_digest`'s order (parameters, then each parameter's
optimizer state), each cut into slices of at most ``MAC_SLICE`` bytes. Slice ``i`` (from 1) gets
``tag_i = GMAC(key, nonce = i as 12 bytes big-endian, AAD = slice bytes)`` (``AESGCM.encrypt`` with an empty
plaintext). The MAC is ``GMAC(key, nonce = 0, AAD = "gputravel/model-mac/v1" || for each tensor: its label,
dtype and shape || its slices' tags)``: tensor names, shapes and order are bound, every byte is authenticated,
and no slice can move.

* CPU tensors are MACed in place (``cryptography`` reads the tensor's own memory through the buffer protocol:
  no copy).
* CUDA tensors are MACed by the GPU cipher (:mod:`core.gpucipher`, the same GHASH kernels that open
  provisioning chunks) straight from device memory, byte-compatible with ``cryptography``; only the 16-byte
  slice tags come back to the host. Where numba-cuda is not usable the slices go through one pinned 4 MiB
  staging buffer instead (``engine`` says which ran).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.procs import name_os_thread
from gputravel.core.protocol.devicelink import MAC_KEY_BYTES

__all__ = ["MAC_KEY_BYTES", "MAC_SLICE", "model_mac", "state_tensors"]

#: bytes per GMAC call (``cryptography`` caps associated data at 2**31 - 1 bytes; 64 MiB keeps the GIL
#: released in long calls and the slice count small)
MAC_SLICE = 64 << 20
_STAGE_BYTES = 4 << 20
#: a state of this many bytes or more in host memory has its slices' tags taken side by side, one thread per core
#: (at most 4): a slice's tag depends on its bytes and index alone, and ``cryptography`` releases the GIL in
#: ``encrypt``; the MAC is the same whichever thread took which tag
MAC_PARALLEL_BYTES = 32 << 20
_DOMAIN = b"gputravel/model-mac/v1\0"


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    """``(label, tensor or plain value)`` in the digest's order: parameters, then their optimizer state."""
    params = list(model.named_parameters())
    for name, p in params:
        yield f"param:{name}", p
    for name, p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            yield f"optim:{name}:{key}", value


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


def model_mac(model: torch.nn.Module, optimizer: torch.optim.Optimizer, key: bytes, *,
              engine: str = "auto") -> tuple[str, str]:
    """The model's MAC under ``key`` (hex) and the engines that computed it (``cpu``, ``gpu``, ``staged``).

    ``engine``: ``auto`` (CPU tensors in place; CUDA tensors by the GPU cipher where numba-cuda drives the
    device, else staged), or ``cpu``/``gpu``/``staged`` for every tensor (``gpu`` on CPU tensors runs the
    kernels in numba's simulator: the tests' cross-check)."""
    if len(key) != MAC_KEY_BYTES:
        raise ValueError(f"a model MAC key is {MAC_KEY_BYTES} bytes, got {len(key)}")
    if engine not in ("auto", "cpu", "gpu", "staged"):
        raise ValueError(f"model MAC engine is auto, cpu, gpu or staged, not {engine!r}")
    aes = AESGCM(key)
    parts: list[bytes | Future[bytes]] = [_DOMAIN]  # the MAC's input, a slice's tag possibly still being taken
    pool = _tag_pool(model, optimizer) if engine in ("auto", "cpu") else None
    try:
        used = _mac_parts(model, optimizer, key, engine, parts, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    head = b"".join(p if isinstance(p, bytes) else p.result() for p in parts)
    tag = aes.encrypt(bytes(12), b"", head)
    return tag.hex(), "+".join(sorted(used)) or "cpu"


def _tag_pool(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ThreadPoolExecutor | None:
    """Threads for the slices' tags where the state in host memory is large and the process has cores for it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    host = sum(v.numel() * v.element_size() for _, v in state_tensors(model, optimizer)
               if isinstance(v, torch.Tensor) and v.device.type == "cpu")
    if cores < 2 or host < MAC_PARALLEL_BYTES:
        return None
    return ThreadPoolExecutor(max_workers=min(4, cores), thread_name_prefix="model-mac",
                              initializer=name_os_thread)


def _mac_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, key: bytes, engine: str,
               parts: list[bytes | Future[bytes]], pool: ThreadPoolExecutor | None) -> set[str]:
    """The MAC's input after its domain, in order, into ``parts``; the CPU slices' tags on ``pool`` where given.
    Returns the engines used."""
    aes = AESGCM(key)
    gpu_mac: _GpuMac | None = None
    stage: torch.Tensor | None = None
    used: set[str] = set()
    index = 0
    for label, value in state_tensors(model, optimizer):
        if not isinstance(value, torch.Tensor):
            parts.append(f"{label}={value!r}\0".encode())
            continue
        t = value.detach().contiguous().reshape(-1)
        parts.append(f"{label}|{t.dtype}|{tuple(value.shape)}\0".encode())
        raw = t.view(torch.uint8)
        count = -(-raw.numel() // MAC_SLICE)
        how = engine
        if how == "auto":
            how = "cpu" if raw.device.type == "cpu" else "gpu"
        if how == "gpu" and gpu_mac is None:
            gpu_mac = _GpuMac(key) if engine == "gpu" else _GpuMac.make(key)
            if gpu_mac is None:
                how = "staged"
        if how == "cpu" and raw.device.type != "cpu":
            how = "staged"
        used.add(how)
        if how == "gpu" and gpu_mac is not None:
            parts.append(gpu_mac.tags(raw, first_nonce=index + 1, count=count))
            index += count
            continue
        for k in range(count):
            index += 1
            piece = raw[k * MAC_SLICE: (k + 1) * MAC_SLICE]
            if how == "cpu":  # the tensor's own memory: no copy
                view = _bytes_view(piece)
                parts.append(aes.encrypt(_nonce(index), b"", view) if pool is None
                             else pool.submit(aes.encrypt, _nonce(index), b"", view))
                continue
            # staged: cryptography takes one AAD per call, so the slice is gathered in one host buffer
            # (``MAC_SLICE`` at most, reused), copied in bounded pieces
            if stage is None:
                stage = torch.empty(MAC_SLICE, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            for pos in range(0, piece.numel(), _STAGE_BYTES):
                end = min(piece.numel(), pos + _STAGE_BYTES)
                stage[pos: end].copy_(piece[pos: end])
            parts.append(aes.encrypt(_nonce(index), b"", _bytes_view(stage[: piece.numel()])))
    return used


class _GpuMac:
    """Slice tags on the GPU: the GPU cipher's seal with an empty plaintext and the slice as AAD (GHASH over
    device memory, then E(K, J0) XOR GHASH), 16 bytes per slice back to the host."""

    def __init__(self, key: bytes) -> None:
        from gputravel.core.gpucipher import GpuAesGcm

        self.engine = GpuAesGcm(key)
        self._dummy = self.engine.cuda.device_array(16, dtype="uint8")

    @classmethod
    def make(cls, key: bytes) -> _GpuMac | None:
        """The GPU engine where numba-cuda drives a real CUDA device, else ``None`` (staged MAC)."""
        try:
            from gputravel.core.gpucipher import backend

            return cls(key) if backend() == "cuda" else None
        except Exception:  # numba-cuda missing or unusable: the staged path is always correct
            return None

    def tags(self, raw: torch.Tensor, *, first_nonce: int, count: int) -> bytes:
        import numpy as np

        from gputravel.core.gpucipher.torch_io import device_bytes

        n = raw.numel()
        if n == 0:
            return b""
        if raw.is_cuda:  # torch's work on the tensor (training on its own stream) is done before numba reads it
            torch.cuda.synchronize(raw.device)
        aligned = raw if raw.data_ptr() % 16 == 0 else raw.clone()  # the kernels read 16-byte aligned AAD
        aad = device_bytes(self.engine, aligned)
        offsets = [k * MAC_SLICE for k in range(count)]
        lengths = [min(MAC_SLICE, n - o) for o in offsets]
        zeros = [0] * count
        plan = self.engine.plan(zeros, src_offsets=zeros, dst_offsets=zeros, aad_lengths=lengths, aad_offsets=offsets)
        nonces = self.engine.nonce_words([_nonce(first_nonce + k) for k in range(count)])
        tags = self.engine.cuda.device_array(4 * count, dtype=np.uint32)
        self.engine.seal_device(plan, nonces, self._dummy, self._dummy, aad, tags)
        return bytes(tags.copy_to_host().astype("<u4").tobytes())


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU ``uint8`` tensor's own memory (no copy)."""
    arr: Any = t.numpy()
    return memoryview(arr).cast("B")
