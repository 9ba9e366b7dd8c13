"""Hash speeds on this CPU, one core each, over one 64 MiB buffer (the size of a large tensor): what the model
digest's format was chosen on (core/training/digest.py).

Prints one JSON object: for each hash (hashlib's sha256, sha512, sha512_256, blake2b, blake2s, sha3_256; BLAKE3;
AES-GMAC, the model MAC's cipher) its MB/s of the hashing thread's CPU time and of the wall clock, best of
``--repeat``; ``ratio_to_sha256`` of CPU speeds; the CPU's SHA extensions (``sha_ni``) and the load average."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MIB = 1 << 20


def _hashes() -> dict[str, Callable[[memoryview], Any]]:
    gmac = AESGCM(os.urandom(32))
    return {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "sha512": lambda b: hashlib.sha512(b).digest(),
        "sha512_256": lambda b: hashlib.new("sha512_256", b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).digest(),
        "blake2s": lambda b: hashlib.blake2s(b).digest(),
        "sha3_256": lambda b: hashlib.sha3_256(b).digest(),
        "blake3": lambda b: blake3.blake3(b).digest(),
        "aes_gmac": lambda b: gmac.encrypt(bytes(12), b"", b),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    buf = memoryview(np.random.default_rng(0).integers(0, 256, args.mib * MIB, dtype=np.uint8))
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    for _ in range(args.repeat):
        for name, fn in _hashes().items():
            t, w = time.thread_time(), time.perf_counter()
            fn(buf)
            c, ww = time.thread_time() - t, time.perf_counter() - w
            cpu[name] = max(cpu.get(name, 0.0), args.mib * MIB / 1e6 / max(c, 1e-9))
            wall[name] = max(wall.get(name, 0.0), args.mib * MIB / 1e6 / max(ww, 1e-9))
    with open("/proc/cpuinfo") as f:
        sha_ni = " sha_ni" in f.read()
    print(json.dumps({"buffer_mib": args.mib, "repeat": args.repeat, "sha_ni": sha_ni,
                      "load_average": [round(x, 2) for x in os.getloadavg()],
                      "cpu_mb_s": {k: round(v, 1) for k, v in cpu.items()},
                      "wall_mb_s": {k: round(v, 1) for k, v in wall.items()},
                      "ratio_to_sha256": {k: round(v / cpu["sha256"], 2) for k, v in cpu.items()}}, indent=1))


if __name__ == "__main__":
    main()
