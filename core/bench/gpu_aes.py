"""``bench gpu-aes``: AES-256-GCM on the GPU against one CPU core, with its correctness evidence.

Every run checks before it measures: the GCM specification's AES-256 cases and a selection of NIST's
CAVP vectors (``vectors_total``/``vectors_passed``), and interoperability with ``cryptography`` in
both directions (GPU seals -> CPU opens, CPU seals -> GPU opens: ``interop_ok``). On a CUDA device it
then times seal and open of device-resident batches per message size; the simulator (no GPU) runs the
same kernels on the CPU, far too slowly for a rate to mean anything, so it reports none.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.gpucipher import GpuAesGcm, LaunchShape, backend
from gputravel.core.gpucipher.vectors import SPEC_VECTORS, cavp_vectors, run_vectors
from gputravel.core.machine import aes_gcm_rate, machine_info

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_SIZES = (64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)
NO_GPU_NOTE = ("no CUDA device: the kernels ran in numba's CUDA simulator on the CPU (correctness only); "
               "GB/s not measured")

Progress = Callable[[str], None]


def interop_check(key: bytes, engine: GpuAesGcm, lengths: Sequence[int], *, seed: int = 16) -> bool:
    """Both directions against ``cryptography`` on random messages and AADs of the given lengths."""
    rng = random.Random(seed)
    aead = AESGCM(key)
    nonces = [rng.randbytes(12) for _ in lengths]
    pts = [rng.randbytes(n) for n in lengths]
    aads = [rng.randbytes(rng.choice((0, 1, 13, 16, 20, 64))) for _ in lengths]
    cts, tags = engine.seal(nonces, pts, aads)
    gpu_to_cpu = all(aead.decrypt(n, c + t, a) == p for n, c, t, a, p in zip(nonces, cts, tags, aads, pts,
                                                                             strict=True))
    sealed = [aead.encrypt(n, p, a) for n, p, a in zip(nonces, pts, aads, strict=True)]
    out = [bytearray(n) for n in lengths]
    ok = engine.open(nonces, [s[:-16] for s in sealed], [s[-16:] for s in sealed], aads, out)
    cpu_to_gpu = all(ok) and all(bytes(o) == p for o, p in zip(out, pts, strict=True))
    return gpu_to_cpu and cpu_to_gpu


def time_device(engine: GpuAesGcm, size: int, *, batch_bytes: int, repeats: int) -> dict[str, Any]:
    """Median GB/s of seal and of open (verify + decrypt) over ``repeats`` runs of one batch of
    ``max(1, batch_bytes // size)`` messages of ``size`` bytes, all in device memory."""
    cuda = engine.cuda
    n = max(1, batch_bytes // size)
    stride = (size + 15) // 16 * 16
    offsets = [i * stride for i in range(n)]
    plan = engine.plan([size] * n, src_offsets=offsets, dst_offsets=offsets, aad_lengths=[16] * n,
                       aad_offsets=[16 * i for i in range(n)])
    rng = np.random.default_rng(size)
    src = cuda.to_device(rng.integers(0, 256, n * stride, dtype=np.uint8))
    ct = cuda.device_array(n * stride, dtype=np.uint8)
    out = cuda.device_array(n * stride, dtype=np.uint8)
    aad = cuda.to_device(rng.integers(0, 256, 16 * n, dtype=np.uint8))
    tags = cuda.device_array(4 * n, dtype=np.uint32)
    seal_s: list[float] = []
    open_s: list[float] = []
    verified = True
    for r in range(repeats + 1):  # the first round compiles and warms up
        nonces = engine.nonce_words([(r * n + i).to_bytes(12, "big") for i in range(n)])
        engine.synchronize()
        t0 = time.perf_counter()
        engine.seal_device(plan, nonces, src, ct, aad, tags)
        engine.synchronize()
        t1 = time.perf_counter()
        ok = engine.open_device(plan, nonces, ct, out, aad, tags)
        engine.synchronize()
        t2 = time.perf_counter()
        if r:
            seal_s.append(t1 - t0)
            open_s.append(t2 - t1)
        verified = verified and bool(ok.copy_to_host()[:n].all())
    total = n * size
    return {"size_bytes": size, "chunks": n, "seal_gb_s": round(total / statistics.median(seal_s) / 1e9, 3),
            "open_gb_s": round(total / statistics.median(open_s) / 1e9, 3), "all_verified": verified}


def run(*, sizes: Sequence[int] = DEFAULT_SIZES, batch_bytes: int = 256 * MIB, repeats: int = 5,
        all_vectors: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """The whole study: correctness evidence, the CPU core's rate, and (on a GPU) GB/s per size."""
    say = progress or (lambda _msg: None)
    chosen = backend()
    say(f"backend: {chosen}")
    vectors = [*SPEC_VECTORS, *(cavp_vectors() if all_vectors else cavp_vectors(per_group=1, tag_bits=(128,)))]
    say(f"known-answer vectors: {len(vectors)}")
    # one short vector per key: in the simulator a 4-thread block launches fastest (same kernels)
    shape = None if chosen == "cuda" else LaunchShape(threads=4, max_blocks=1, ctr_blocks=4, ghash_blocks=8,
                                                      join_fan=8)
    vec = run_vectors(vectors, shape=shape)
    key = os.urandom(32)
    engine = GpuAesGcm(key)
    say("interop with cryptography, both directions")
    small = [0, 1, 15, 16, 17, 64, 255, 1000, 4096]
    interop = interop_check(key, engine, small + ([MIB, 3 * MIB + 5] if chosen == "cuda" else []))
    cpu_size = min(max(sizes), 16 * MIB)
    say(f"one CPU core: cryptography AESGCM.decrypt_into on {cpu_size} B")
    cpu_gb_s = aes_gcm_rate(cpu_size) / 1e9
    rows: list[dict[str, Any]] = []
    for size in sizes:
        if chosen == "cuda":
            say(f"GPU seal/open, {size} B messages")
            row = time_device(engine, size, batch_bytes=batch_bytes, repeats=repeats)
            row["open_vs_cpu_1core"] = round(row["open_gb_s"] / cpu_gb_s, 2)
        else:
            row = {"size_bytes": size, "chunks": max(1, batch_bytes // size), "seal_gb_s": None,
                   "open_gb_s": None, "all_verified": None, "open_vs_cpu_1core": None}
        rows.append(row)
    return {"benchmark": "gpu-aes", "backend": chosen, "machine": machine_info(),
            "vectors_total": vec.total, "vectors_passed": vec.passed, "vector_failures": vec.failures[:20],
            "interop_ok": interop, "cpu_1core_gb_s": round(cpu_gb_s, 3), "cpu_1core_size_bytes": cpu_size,
            "batch_bytes": batch_bytes, "repeats": repeats, "rows": rows,
            "note": None if chosen == "cuda" else NO_GPU_NOTE,
            "measures": "kernel time on device-resident batches (host transfers excluded); open = verify "
                        "every tag, then decrypt the verified chunks"}
