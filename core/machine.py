"""What a benchmark prints with every figure: the machine it ran on."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Cores this process may use, CPU model, accelerator, versions."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = torch.cuda.is_available()
    return {"cores": cores, "cpu": cpu_model(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "cuda": cuda, "python": sys.version.split()[0], "torch": torch.__version__,
            "platform": platform.platform()}


#: a rate that is a ceiling is the best of this many equal windows of its time: a busy machine (another
#: process taking the core for part of a window) only ever lowers a window's rate
WINDOWS = 5


def _best_rate(one: Any, chunk: int, seconds: float) -> float:
    best = 0.0
    for _ in range(WINDOWS):
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / WINDOWS:
            one()
            n += 1
        best = max(best, n * chunk / (time.perf_counter() - t0))
    return best


def aes_gcm_rate(chunk: int, *, seconds: float = 0.5) -> float:
    """Single-core AES-256-GCM decrypt_into rate (bytes/s) on ``chunk``-byte messages of random data (the best
    of ``WINDOWS`` windows of ``seconds`` in all)."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    ct = aead.encrypt(nonce, os.urandom(chunk), b"aad")
    out = bytearray(chunk)
    return _best_rate(lambda: aead.decrypt_into(nonce, ct, b"aad", out), chunk, seconds)


def aes_gcm_seal_rate(chunk: int, *, seconds: float = 0.5) -> float:
    """Single-core AES-256-GCM encrypt_into rate (bytes/s) on ``chunk``-byte messages of random data (the best
    of ``WINDOWS`` windows of ``seconds`` in all)."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    src = os.urandom(chunk)
    out = bytearray(chunk + 16)
    return _best_rate(lambda: aead.encrypt_into(nonce, src, b"aad", out), chunk, seconds)


def aes_gcm_stream_rates(size: int, chunk: int, *, rounds: int = 5) -> dict[str, float]:
    """One core's AES-256-GCM seal and open rates (bytes/s, the best of ``rounds`` passes: a ceiling) over a
    ``size``-byte buffer in ``chunk``-byte messages, the least memory traffic any ring pays for it: seal reads a
    ``size``-byte source into a few reused ciphertext slots, open writes a ``size``-byte destination from a reused
    ciphertext. Where ``size`` is far beyond the caches this is the memory's rate, not the AES unit's."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    chunk = max(1, min(chunk, size))
    n = max(1, size // chunk)
    src = memoryview(bytearray(os.urandom(chunk)) * n)
    slots = [bytearray(chunk + 16) for _ in range(4)]
    ct = aead.encrypt(nonce, bytes(src[:chunk]), b"")
    dst = memoryview(bytearray(n * chunk))
    best = {"seal": 0.0, "open": 0.0}
    for r in range(rounds + 1):  # the first round touches every page, untimed
        t0 = time.perf_counter()
        for i in range(n):
            aead.encrypt_into(nonce, src[i * chunk:(i + 1) * chunk], b"", slots[i % 4])
        t1 = time.perf_counter()
        for i in range(n):
            aead.decrypt_into(nonce, ct, b"", dst[i * chunk:(i + 1) * chunk])
        t2 = time.perf_counter()
        if r:
            best = {"seal": max(best["seal"], n * chunk / (t1 - t0)), "open": max(best["open"], n * chunk / (t2 - t1))}
    return best


def _cipher_pass(mode: str, size: int, chunk: int, rounds: int, start: Any, out: Any) -> None:
    """One process of ``aes_gcm_pair_rate``: ``rounds`` passes over ``size`` bytes, the best rate."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    n = max(1, size // chunk)
    if mode == "seal":  # from a ``size``-byte source (as a holder's shard) into a few reused slots (as the ring)
        src = memoryview(bytearray(os.urandom(chunk)) * n)
        slots = [bytearray(chunk + 16) for _ in range(4)]

        def one(i: int) -> None:
            aead.encrypt_into(nonce, src[i * chunk:(i + 1) * chunk], b"", slots[i % 4])
    else:  # into a ``size``-byte destination (as the device's buffer)
        ct = aead.encrypt(nonce, os.urandom(chunk), b"")
        dst = memoryview(bytearray(n * chunk))

        def one(i: int) -> None:
            aead.decrypt_into(nonce, ct, b"", dst[i * chunk:(i + 1) * chunk])
    for i in range(n):  # touch every page before timing
        one(i)
    start.wait()
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            one(i)
        rates.append(n * chunk / (time.perf_counter() - t0))
    out.put((mode, max(rates)))


def aes_gcm_pair_rate(size: int, chunk: int, *, rounds: int = 10) -> dict[str, float]:
    """AES-256-GCM with both ends busy at once, as a provisioning pipeline has them: one process seals
    ``size`` bytes from memory while another opens ``size`` bytes into memory (bytes/s of each, the best
    of ``rounds``: a ceiling). On a machine whose memory, not its AES unit, binds, this is well below twice the
    single-core rate: it is the most a seal-then-open pipeline can reach there, whatever its protocol."""
    import multiprocessing as mp

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    start = ctx.Barrier(2)
    out = ctx.Queue()
    procs = [ctx.Process(target=_cipher_pass, args=(m, size, chunk, rounds, start, out), daemon=True)
             for m in ("seal", "open")]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    return {"seal": float(got["seal"]), "open": float(got["open"])}


def _pipeline_opener(sock: Any, ring: Any, size: int, chunk: int, slots: int, key: bytes) -> None:
    """The opening end of ``ring_pipeline_rate``: a slot id in, ``decrypt_into`` its chunk at its place in a
    ``size``-byte destination, an acknowledgement out for every half ring (and the last chunk)."""
    aead = AESGCM(key)
    dst = memoryview(bytearray(size))
    dst[:] = bytes(size)  # touch every page before timing
    view = memoryview(ring)
    n, batch, width = size // chunk, max(1, slots // 2), chunk + 16
    while True:
        held = 0
        for _ in range(n):
            head = sock.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            i = int.from_bytes(head, "little")
            k = i % slots
            aead.decrypt_into(i.to_bytes(12, "big"), view[k * width:(k + 1) * width], b"",
                              dst[i * chunk:(i + 1) * chunk])
            held += 1
            if held == batch or i == n - 1:
                sock.sendall(held.to_bytes(4, "little"))
                held = 0


def ring_pipeline_rate(size: int, chunk: int, *, slots: int = 8, rounds: int = 15) -> dict[str, float]:
    """A bare seal -> shared ring -> open pipeline, no protocol: one process seals ``size`` bytes from memory
    into a ``slots``-slot shared ring and sends each slot's id on a socket pair; another opens each chunk into
    its place in memory and acknowledges every half ring, which frees slots. Bytes/s end to end, the best
    and the median of ``rounds``. What any same-host ring path can reach on this machine: two cipher passes
    at once, memory shared between them, the cost of waking the other side."""
    import mmap
    import multiprocessing as mp
    import statistics

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    key = os.urandom(32)
    width, n = chunk + 16, max(1, size // chunk)
    size = n * chunk
    ring = mmap.mmap(-1, slots * width)
    here, there = socket.socketpair()
    here.settimeout(60)  # an opening process that hangs fails the measurement instead of the benchmark
    proc = ctx.Process(target=_pipeline_opener, args=(there, ring, size, chunk, slots, key), daemon=True)
    proc.start()
    there.close()
    aead = AESGCM(key)
    src = memoryview(bytearray(os.urandom(chunk)) * n)
    view = memoryview(ring)
    rates: list[float] = []
    try:
        for r in range(rounds + 1):  # the first round warms both ends (page faults, caches)
            t0 = time.perf_counter()
            free, acked, i = slots, 0, 0
            while acked < n:
                while i < n and free:
                    k = i % slots
                    aead.encrypt_into(i.to_bytes(12, "big"), src[i * chunk:(i + 1) * chunk], b"",
                                      view[k * width:(k + 1) * width])
                    here.sendall(i.to_bytes(4, "little"))
                    i += 1
                    free -= 1
                got = here.recv(4, socket.MSG_WAITALL)
                if len(got) < 4:
                    raise RuntimeError("the pipeline's opening process ended early")
                freed = int.from_bytes(got, "little")
                acked += freed
                free += freed
            if r:
                rates.append(size / (time.perf_counter() - t0))
    finally:
        here.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
        view.release()
        ring.close()
    return {"best": max(rates), "median": statistics.median(rates)}
