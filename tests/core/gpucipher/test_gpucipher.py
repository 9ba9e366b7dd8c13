"""AES-256-GCM on the GPU (core/gpucipher), checked in numba's CUDA simulator where there is no GPU:
the same kernel source as on a device. Known answers (GCM specification, NIST CAVP), differential
tests against ``cryptography`` in both directions, tamper tests, and the ``bench gpu-aes`` report."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.gpucipher import (
    GpuAesGcm,
    GpuCipherError,
    LaunchShape,
    backend,
    open_batch,
    open_into_tensor,
    seal_batch,
    seal_from_tensor,
)
from gputravel.core.gpucipher.backend import cuda_device_present
from gputravel.core.gpucipher.reference import aes_encrypt_block, expand_key_le, ghash
from gputravel.core.gpucipher.vectors import SPEC_VECTORS, cavp_vectors, run_vectors

#: Lengths around every block boundary, empty included.
LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 47, 100, 255, 256, 257, 1000]
#: A tiny launch shape: two-block segments joined two at a time (many join levels, several thread
#: blocks in the grid-stride loops) to exercise the GHASH tree on small inputs.
TINY = LaunchShape(threads=8, max_blocks=2, ctr_blocks=2, ghash_blocks=2, join_fan=2)


def batch(rng: random.Random, lengths: list[int]) -> tuple[list[bytes], list[bytes], list[bytes]]:
    nonces = [rng.randbytes(12) for _ in lengths]
    pts = [rng.randbytes(n) for n in lengths]
    aads = [rng.randbytes(rng.choice((0, 1, 12, 16, 17, 40))) for _ in lengths]
    return nonces, pts, aads


def test_backend_is_the_simulator_where_no_cuda_device_exists() -> None:
    assert backend() in ("cuda", "simulator")
    if not cuda_device_present():
        assert backend() == "simulator"


def test_host_reference_matches_cryptography() -> None:
    rng = random.Random(1)
    key, nonce, pt, aad = rng.randbytes(32), rng.randbytes(12), rng.randbytes(70), rng.randbytes(9)
    rk = expand_key_le(key)
    h = int.from_bytes(aes_encrypt_block(rk, bytes(16)), "big")
    sealed = AESGCM(key).encrypt(nonce, pt, aad)
    mask = aes_encrypt_block(rk, nonce + b"\0\0\0\1")
    assert (ghash(h, aad, sealed[:-16]) ^ int.from_bytes(mask, "big")).to_bytes(16, "big") == sealed[-16:]


def test_gcm_specification_cases_13_to_16_seal_and_open() -> None:
    report = run_vectors(SPEC_VECTORS)
    assert (report.total, report.passed, report.failures) == (4, 4, [])


def test_nist_cavp_selection_passes_including_the_vectors_that_must_fail() -> None:
    vectors = cavp_vectors(per_group=1, tag_bits=(128,))
    # 25 (PT, AAD) length sections: one encrypt record, one valid and one FAIL decrypt record each
    assert len(vectors) == 75 and sum(not v.valid for v in vectors) == 25
    report = run_vectors(vectors, shape=CAVP_SHAPE)
    assert report.failures == [] and report.passed == report.total == 75


#: The launch shape the CAVP runs use in the simulator: small, so each record's kernels run few Python threads.
CAVP_SHAPE = LaunchShape(threads=4, max_blocks=1, ctr_blocks=4, ghash_blocks=8, join_fan=8)


@pytest.mark.slow
def test_nist_cavp_two_records_of_every_group_pass() -> None:
    """Every group of the CAVP files (each PT and AAD length, each of the 7 tag lengths, valid and FAIL
    decrypt records), two records (two keys) each: 450 records, about a minute in the simulator."""
    vectors = cavp_vectors(per_group=2)
    assert len(vectors) == 450 and sum(not v.valid for v in vectors) == 50
    report = run_vectors(vectors, shape=CAVP_SHAPE)
    assert report.failures == [] and report.passed == 450


@pytest.mark.gpu(simulator_env="GPUTRAVEL_CAVP")
@pytest.mark.timeout(1800)  # 3000 keys, one engine each: seconds on a GPU, about 8 minutes in the simulator
def test_nist_cavp_every_96_bit_iv_record_passes() -> None:
    """All 3000 records: on a GPU (``-m gpu``, ``make gpu-check``). The simulator runs them too with
    ``GPUTRAVEL_CAVP=full`` (the slow set's two records of every group take a seventh of its time)."""
    vectors = cavp_vectors()
    assert len(vectors) == 3000  # 2625 encrypt records (7 tag lengths) + 375 decrypt (128-bit tags)
    report = run_vectors(vectors, shape=CAVP_SHAPE)
    assert report.failures == [] and report.passed == 3000


@pytest.mark.parametrize("shape", [None, TINY], ids=["default", "tiny-shape"])
def test_gpu_seals_what_cryptography_opens_byte_for_byte(shape: LaunchShape | None) -> None:
    rng = random.Random(2)
    key = rng.randbytes(32)
    nonces, pts, aads = batch(rng, LENGTHS)
    cts, tags = GpuAesGcm(key, shape=shape).seal(nonces, pts, aads)
    aead = AESGCM(key)
    for n, p, a, c, t in zip(nonces, pts, aads, cts, tags, strict=True):
        assert c + t == aead.encrypt(n, p, a)
        assert aead.decrypt(n, c + t, a) == p


@pytest.mark.parametrize("shape", [None, TINY], ids=["default", "tiny-shape"])
def test_gpu_opens_what_cryptography_seals(shape: LaunchShape | None) -> None:
    rng = random.Random(3)
    key = rng.randbytes(32)
    lengths = LENGTHS + [rng.randrange(0, 3000) for _ in range(6)]
    nonces, pts, aads = batch(rng, lengths)
    sealed = [AESGCM(key).encrypt(n, p, a) for n, p, a in zip(nonces, pts, aads, strict=True)]
    out = [bytearray(len(p)) for p in pts]
    ok = GpuAesGcm(key, shape=shape).open(nonces, [s[:-16] for s in sealed], [s[-16:] for s in sealed], aads,
                                          out)
    assert ok == [True] * len(lengths)
    assert [bytes(o) for o in out] == pts


def test_module_level_batch_functions_round_trip() -> None:
    rng = random.Random(4)
    key = rng.randbytes(32)
    nonces, pts, aads = batch(rng, [5, 64, 0])
    cts, tags = seal_batch(key, nonces, pts, aads)
    out = [bytearray(len(p)) for p in pts]
    assert open_batch(key, nonces, cts, tags, aads, out) == [True, True, True]
    assert [bytes(o) for o in out] == pts


def flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


@pytest.mark.parametrize("field", ["ciphertext", "tag", "aad", "nonce"])
def test_any_flipped_bit_rejects_that_chunk_only_and_writes_nothing_for_it(field: str) -> None:
    rng = random.Random(5)
    key = rng.randbytes(32)
    n_good = 3
    base_nonce, pt, aad = rng.randbytes(12), rng.randbytes(45), rng.randbytes(21)
    nbits = {"ciphertext": 45 * 8, "tag": 128, "aad": 21 * 8, "nonce": 96}[field]
    bits = sorted({0, 7, nbits - 1, *rng.sample(range(nbits), 9)})
    # chunk i (i >= n_good) is chunk 0 with one bit flipped; every chunk has its own nonce
    nonces = [base_nonce[:8] + i.to_bytes(4, "big") for i in range(n_good)]
    sealed = [AESGCM(key).encrypt(n, pt, aad) for n in nonces]
    cts = [s[:-16] for s in sealed]
    tags = [s[-16:] for s in sealed]
    aads = [aad] * n_good
    for bit in bits:
        c, t, a, n = cts[0], tags[0], aad, nonces[0]
        if field == "ciphertext":
            c = flip(c, bit)
        elif field == "tag":
            t = flip(t, bit)
        elif field == "aad":
            a = flip(a, bit)
        else:
            n = flip(n, bit)
        cts.append(c)
        tags.append(t)
        aads.append(a)
        nonces.append(n)
    sentinel = b"\xa5" * len(pt)
    out = [bytearray(sentinel) for _ in cts]
    ok = GpuAesGcm(key).open(nonces, cts, tags, aads, out)
    assert ok == [True] * n_good + [False] * len(bits)
    assert all(bytes(o) == pt for o in out[:n_good])
    assert all(bytes(o) == sentinel for o in out[n_good:])


def test_open_into_tensor_writes_only_verified_chunks_into_the_window() -> None:
    rng = random.Random(6)
    key = rng.randbytes(32)
    lengths = [64, 32, 48, 20]  # back to back: every chunk but the last a multiple of 16 bytes
    nonces, pts, aads = batch(rng, lengths)
    sealed = [AESGCM(key).encrypt(n, p, a) for n, p, a in zip(nonces, pts, aads, strict=True)]
    ciphertext = torch.tensor(list(b"".join(s[:-16] for s in sealed)), dtype=torch.uint8)
    tags = [s[-16:] for s in sealed]
    tags[1] = flip(tags[1], 77)
    window = torch.full((sum(lengths),), 0x5A, dtype=torch.uint8)
    ok = open_into_tensor(key, nonces, ciphertext, tags, aads, window, lengths=lengths)
    assert ok == [True, False, True, True]
    got = bytes(window.numpy())
    assert got[:64] == pts[0] and got[64:96] == b"\x5a" * 32
    assert got[96:144] == pts[2] and got[144:] == pts[3]


def test_seal_from_tensor_matches_cryptography_and_can_seal_in_place() -> None:
    rng = random.Random(7)
    key = rng.randbytes(32)
    lengths = [32, 16, 7]
    nonces, pts, aads = batch(rng, lengths)
    buf = np.frombuffer(b"".join(pts), dtype=np.uint8).copy()
    tags = seal_from_tensor(key, nonces, buf, aads, buf, lengths=lengths)  # in place
    pos = 0
    for n, p, a, t, ln in zip(nonces, pts, aads, tags, lengths, strict=True):
        assert buf[pos:pos + ln].tobytes() + t == AESGCM(key).encrypt(n, p, a)
        pos += ln


def test_bad_inputs_raise_named_errors() -> None:
    with pytest.raises(GpuCipherError, match="32-byte key"):
        GpuAesGcm(bytes(16))
    eng = GpuAesGcm(bytes(32))
    with pytest.raises(GpuCipherError, match="12 bytes"):
        eng.seal([bytes(8)], [b"x"], [b""])
    with pytest.raises(GpuCipherError, match="one entry per chunk"):
        eng.seal([bytes(12)], [b"x", b"y"], [b""])
    with pytest.raises(GpuCipherError, match="exactly as long"):
        eng.open([bytes(12)], [b"abc"], [bytes(16)], [b""], [bytearray(2)])
    with pytest.raises(GpuCipherError, match="16 bytes"):
        eng.open([bytes(12)], [b"abc"], [bytes(8)], [b""], [bytearray(3)])
    with pytest.raises(GpuCipherError, match="multiples of 16"):
        open_into_tensor(eng, [bytes(12)] * 2, np.zeros(64, np.uint8), [bytes(16)] * 2, [b""] * 2,
                         np.zeros(64, np.uint8), lengths=[20, 20])


@pytest.mark.process
def test_bench_gpu_aes_reports_vectors_interop_and_no_rates_in_the_simulator() -> None:
    res = subprocess.run([sys.executable, "-m", "gputravel.console.cli", "bench", "gpu-aes", "--json", "--sizes",
                          "64K,1M", "--batch-mib", "4"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert r["benchmark"] == "gpu-aes" and r["backend"] in ("cuda", "simulator")
    assert r["vectors_total"] == 79 and r["vectors_passed"] == 79  # 4 spec cases + 75 CAVP records
    assert r["interop_ok"] is True and r["cpu_1core_gb_s"] > 0
    assert [row["size_bytes"] for row in r["rows"]] == [64 << 10, 1 << 20]
    assert [row["chunks"] for row in r["rows"]] == [64, 4]
    for row in r["rows"]:
        if r["backend"] == "simulator":
            assert row["seal_gb_s"] is None and row["open_gb_s"] is None
            assert "not measured" in r["note"]
        else:
            assert row["seal_gb_s"] > 0 and row["open_gb_s"] > 0 and row["all_verified"] is True


PTX_CHECK = r"""
import os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
os.environ["GPUTRAVEL_GPU_CIPHER"] = "cuda"
from numba import cuda, types as t
import numba.cuda.dispatcher as dispatcher
import gputravel.core.gpucipher.kernels as k

class H100:  # no driver on this machine: device functions ask the current device for its arch
    compute_capability = (9, 0)

dispatcher.get_current_device = lambda: H100()
u32, u8, i64 = (t.Array(x, 1, "C") for x in (t.uint32, t.uint8, t.int64))
n = t.int64
sigs = {"ctr_kernel": (u32, u32, u32, u32, u8, u32, u8, i64, i64, i64, i64, n, n, u8),
        "ghash_segments_kernel": (u32, u32, u8, i64, i64, u32, u8, i64, i64, i64, n, n, u32),
        "ghash_join_kernel": (u32, n, u32, i64, i64, n, n, u32),
        "tag_kernel": (u32, u32, u32, u32, n, u32, n, u8)}
for name, sig in sigs.items():
    ptx, _ = cuda.compile_ptx(getattr(k, name).py_func, sig, cc=(9, 0))
    assert ".target sm_90" in ptx and "ld.local" not in ptx, name
    print(name, len(ptx))
"""


@pytest.mark.process
def test_kernels_compile_to_ptx_for_an_h100_with_nvvm() -> None:
    """The simulator checks the kernels' arithmetic; this checks that numba's CUDA target types and
    compiles the very same source for sm_90 (NVVM from the ``gpu`` extra), with no register spills."""
    res = subprocess.run([sys.executable, "-c", PTX_CHECK], capture_output=True, text=True, timeout=300)
    if res.returncode and ("libnvvm" in res.stderr or "libnvrtc" in res.stderr) and "not" in res.stderr.lower():
        pytest.skip("NVVM/NVRTC not installed (pip install 'gputravel[gpu]')")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line.split()[0] for line in res.stdout.splitlines()) == [
        "ctr_kernel", "ghash_join_kernel", "ghash_segments_kernel", "tag_kernel"]


@pytest.mark.process
def test_importing_the_kernel_module_first_still_picks_the_simulator_without_cuda() -> None:
    """A module walk (tests/console/cli/test_cli_errors.py imports every module) may import the kernels before anyone
    asked for a backend: the simulator flag must be fixed before numba.cuda loads, or every later GPU cipher
    call in that process looks for a CUDA driver."""
    code = ("import os\nos.environ.pop('NUMBA_ENABLE_CUDASIM', None)\nos.environ.pop('GPUTRAVEL_GPU_CIPHER', None)\n"
            "import gputravel.core.gpucipher.kernels\n"
            "from gputravel.core.gpucipher.backend import backend, cuda_device_present\n"
            "print(backend(), cuda_device_present())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    chosen, present = res.stdout.split()
    assert chosen == ("cuda" if present == "True" else "simulator")
