"""What a benchmark prints with every figure: the machine it ran on."""

from __future__ import annotations

import os
import platform
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


def aes_gcm_rate(chunk: int, *, seconds: float = 0.5) -> float:
    """Single-core AES-256-GCM decrypt_into rate (bytes/s) on ``chunk``-byte messages of random data."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    ct = aead.encrypt(nonce, os.urandom(chunk), b"aad")
    out = bytearray(chunk)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        aead.decrypt_into(nonce, ct, b"aad", out)
        n += 1
    return n * chunk / (time.perf_counter() - t0)
