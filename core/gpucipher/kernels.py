"""The AES-256-CTR and GHASH kernels (numba-cuda). The same source runs on a GPU and in numba's simulator.

Import through :func:`gputravel.core.gpucipher.backend.kernels`, which picks the backend first (the
simulator flag must be set before ``numba.cuda`` is imported).

Data are little-endian 32-bit words of memory bytes; every arithmetic result is cast back to
``np.uint32`` so numba's integer promotion on the GPU and NumPy's in the simulator agree bit for bit.
Work is spread by flat task lists: a thread finds its chunk by binary search over a cumulative count
(``cum``), so one launch covers a whole batch of chunks of any sizes, and grid-stride loops let a small
grid (the simulator's) cover any amount of work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from numba import cuda as _numba_cuda  # type: ignore[import-untyped,unused-ignore]

cuda: Any = _numba_cuda
F = TypeVar("F", bound=Callable[..., Any])


def device_function(fn: F) -> F:
    """``cuda.jit(device=True)`` with its type kept (numba has no type stubs)."""
    return cast(F, cuda.jit(device=True)(fn))


def kernel(fn: Callable[..., None]) -> Any:
    """``cuda.jit``: the result is launched as ``kernel[grid, threads](...)``."""
    return cuda.jit(fn)

#: Shared-memory banks: the T-table is replicated once per bank, entry x of copy l at word x*32 + l,
#: so thread lane l only ever reads bank l: no bank conflicts, and no data-dependent ones.
LANES = 32
TABLE_WORDS = 256 * LANES
#: GHASH nibble tables for one multiplier: 32 nibble positions x 16 values x 4 words.
HTAB_WORDS = 32 * 16 * 4
ALL_ONES = 0xFFFFFFFF


@device_function
def bswap(v: Any) -> Any:
    return np.uint32(((v & 0xFF) << 24) | ((v & 0xFF00) << 8) | ((v >> 8) & 0xFF00) | (v >> 24))


@device_function
def rotl8(v: Any) -> Any:
    return np.uint32(((v << 8) & ALL_ONES) | (v >> 24))


@device_function
def rotl16(v: Any) -> Any:
    return np.uint32(((v << 16) & ALL_ONES) | (v >> 16))


@device_function
def rotl24(v: Any) -> Any:
    return np.uint32(((v << 24) & ALL_ONES) | (v >> 8))


@device_function
def find_chunk(cum: Any, nchunks: Any, t: Any) -> Any:
    """The chunk c with cum[c] <= t < cum[c+1] (empty chunks own no task)."""
    lo = 0
    hi = nchunks
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if cum[mid] <= t:
            lo = mid
        else:
            hi = mid
    return lo


@device_function
def aes_block(tab: Any, stride: Any, lane: Any, rk: Any, c0: Any, c1: Any, c2: Any, c3: Any) -> Any:
    """AES-256 of one block (4 LE words) with the one-table formulation (T1..T3 are rotations of T0,
    S is byte 1 of T0). ``tab[x * stride + lane]`` is T0[x]: stride 32 for the per-bank copies in
    shared memory, stride 1 and lane 0 for the plain table in global memory."""
    s0 = np.uint32(c0 ^ rk[0])
    s1 = np.uint32(c1 ^ rk[1])
    s2 = np.uint32(c2 ^ rk[2])
    s3 = np.uint32(c3 ^ rk[3])
    for r in range(1, 14):
        k = 4 * r
        t0 = (tab[(s0 & 0xFF) * stride + lane] ^ rotl8(tab[((s1 >> 8) & 0xFF) * stride + lane])
              ^ rotl16(tab[((s2 >> 16) & 0xFF) * stride + lane]) ^ rotl24(tab[(s3 >> 24) * stride + lane])
              ^ rk[k])
        t1 = (tab[(s1 & 0xFF) * stride + lane] ^ rotl8(tab[((s2 >> 8) & 0xFF) * stride + lane])
              ^ rotl16(tab[((s3 >> 16) & 0xFF) * stride + lane]) ^ rotl24(tab[(s0 >> 24) * stride + lane])
              ^ rk[k + 1])
        t2 = (tab[(s2 & 0xFF) * stride + lane] ^ rotl8(tab[((s3 >> 8) & 0xFF) * stride + lane])
              ^ rotl16(tab[((s0 >> 16) & 0xFF) * stride + lane]) ^ rotl24(tab[(s1 >> 24) * stride + lane])
              ^ rk[k + 2])
        t3 = (tab[(s3 & 0xFF) * stride + lane] ^ rotl8(tab[((s0 >> 8) & 0xFF) * stride + lane])
              ^ rotl16(tab[((s1 >> 16) & 0xFF) * stride + lane]) ^ rotl24(tab[(s2 >> 24) * stride + lane])
              ^ rk[k + 3])
        s0 = np.uint32(t0)
        s1 = np.uint32(t1)
        s2 = np.uint32(t2)
        s3 = np.uint32(t3)
    o0 = ((tab[(s0 & 0xFF) * stride + lane] >> 8) & 0xFF) | (tab[((s1 >> 8) & 0xFF) * stride + lane] & 0xFF00) \
        | ((tab[((s2 >> 16) & 0xFF) * stride + lane] << 8) & 0xFF0000) \
        | ((tab[(s3 >> 24) * stride + lane] << 16) & 0xFF000000)
    o1 = ((tab[(s1 & 0xFF) * stride + lane] >> 8) & 0xFF) | (tab[((s2 >> 8) & 0xFF) * stride + lane] & 0xFF00) \
        | ((tab[((s3 >> 16) & 0xFF) * stride + lane] << 8) & 0xFF0000) \
        | ((tab[(s0 >> 24) * stride + lane] << 16) & 0xFF000000)
    o2 = ((tab[(s2 & 0xFF) * stride + lane] >> 8) & 0xFF) | (tab[((s3 >> 8) & 0xFF) * stride + lane] & 0xFF00) \
        | ((tab[((s0 >> 16) & 0xFF) * stride + lane] << 8) & 0xFF0000) \
        | ((tab[(s1 >> 24) * stride + lane] << 16) & 0xFF000000)
    o3 = ((tab[(s3 & 0xFF) * stride + lane] >> 8) & 0xFF) | (tab[((s0 >> 8) & 0xFF) * stride + lane] & 0xFF00) \
        | ((tab[((s1 >> 16) & 0xFF) * stride + lane] << 8) & 0xFF0000) \
        | ((tab[(s2 >> 24) * stride + lane] << 16) & 0xFF000000)
    return (np.uint32(o0 ^ rk[56]), np.uint32(o1 ^ rk[57]), np.uint32(o2 ^ rk[58]), np.uint32(o3 ^ rk[59]))


@device_function
def load_block(src32: Any, src8: Any, off: Any, length: Any, j: Any) -> Any:
    """Block j of a ``length``-byte message at byte offset ``off`` (a multiple of 16), zero padded."""
    if 16 * (j + 1) <= length:
        w = (off >> 2) + 4 * j
        return (np.uint32(src32[w]), np.uint32(src32[w + 1]), np.uint32(src32[w + 2]), np.uint32(src32[w + 3]))
    x0 = np.uint32(0)
    x1 = np.uint32(0)
    x2 = np.uint32(0)
    x3 = np.uint32(0)
    base = off + 16 * j
    for i in range(length - 16 * j):
        bv = np.uint32(np.uint32(src8[base + i]) << (8 * (i & 3)))
        q = i >> 2
        if q == 0:
            x0 = np.uint32(x0 | bv)
        elif q == 1:
            x1 = np.uint32(x1 | bv)
        elif q == 2:
            x2 = np.uint32(x2 | bv)
        else:
            x3 = np.uint32(x3 | bv)
    return (x0, x1, x2, x3)


@device_function
def table_mul(htab: Any, x0: Any, x1: Any, x2: Any, x3: Any) -> Any:
    """X * H with H's nibble tables: the XOR of 32 table entries picked by X's nibbles."""
    z0 = np.uint32(0)
    z1 = np.uint32(0)
    z2 = np.uint32(0)
    z3 = np.uint32(0)
    for q in range(4):
        xw = x0
        if q == 1:
            xw = x1
        elif q == 2:
            xw = x2
        elif q == 3:
            xw = x3
        for k in range(8):
            e = ((q * 8 + k) * 16 + ((xw >> (4 * k)) & 0xF)) * 4
            z0 = np.uint32(z0 ^ htab[e])
            z1 = np.uint32(z1 ^ htab[e + 1])
            z2 = np.uint32(z2 ^ htab[e + 2])
            z3 = np.uint32(z3 ^ htab[e + 3])
    return (z0, z1, z2, z3)


@device_function
def gf_mul(a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any, b2: Any, b3: Any) -> Any:
    """Generic GF(2^128) product (GCM bit order) of two elements in LE words, bit-serial and
    branch-free on the bits; used only to join partial sums (once per segment, not per block)."""
    x0 = bswap(a0)
    x1 = bswap(a1)
    x2 = bswap(a2)
    x3 = bswap(a3)
    v0 = bswap(b0)
    v1 = bswap(b1)
    v2 = bswap(b2)
    v3 = bswap(b3)
    z0 = np.uint32(0)
    z1 = np.uint32(0)
    z2 = np.uint32(0)
    z3 = np.uint32(0)
    for q in range(4):
        xw = x0
        if q == 1:
            xw = x1
        elif q == 2:
            xw = x2
        elif q == 3:
            xw = x3
        for bit in range(31, -1, -1):
            m = np.uint32(((xw >> bit) & 1) * ALL_ONES)
            z0 = np.uint32(z0 ^ (v0 & m))
            z1 = np.uint32(z1 ^ (v1 & m))
            z2 = np.uint32(z2 ^ (v2 & m))
            z3 = np.uint32(z3 ^ (v3 & m))
            red = np.uint32((v3 & 1) * 0xE1000000)
            v3 = np.uint32((v3 >> 1) | ((v2 & 1) << 31))
            v2 = np.uint32((v2 >> 1) | ((v1 & 1) << 31))
            v1 = np.uint32((v1 >> 1) | ((v0 & 1) << 31))
            v0 = np.uint32((v0 >> 1) ^ red)
    return (bswap(z0), bswap(z1), bswap(z2), bswap(z3))


@kernel
def ctr_kernel(te: Any, rk_g: Any, nonces: Any, src32: Any, src8: Any, dst32: Any, dst8: Any, src_off: Any,
               dst_off: Any, nbytes: Any, cum: Any, nchunks: Any, bpt: Any, ok: Any) -> None:
    """AES-256-CTR: dst = src XOR E(K, nonce || BE32(2 + b)) for block b of every chunk whose ``ok`` is
    set; each task is ``bpt`` consecutive blocks of one chunk. Chunks with ``ok == 0`` are not written."""
    tab = cuda.shared.array(TABLE_WORDS, np.uint32)
    rk = cuda.shared.array(60, np.uint32)
    tid = cuda.threadIdx.x
    for i in range(tid, TABLE_WORDS, cuda.blockDim.x):
        tab[i] = te[i >> 5]
    for i in range(tid, 60, cuda.blockDim.x):
        rk[i] = rk_g[i]
    cuda.syncthreads()
    lane = tid & (LANES - 1)
    for task in range(cuda.grid(1), cum[nchunks], cuda.gridsize(1)):
        c = find_chunk(cum, nchunks, task)
        if ok[c] == 0:
            continue
        n = nbytes[c]
        b0 = (task - cum[c]) * bpt
        b1 = min(b0 + bpt, (n + 15) >> 4)
        n0 = nonces[3 * c]
        n1 = nonces[3 * c + 1]
        n2 = nonces[3 * c + 2]
        so = src_off[c]
        do = dst_off[c]
        for b in range(b0, b1):
            k0, k1, k2, k3 = aes_block(tab, LANES, lane, rk, n0, n1, n2, bswap(np.uint32(b + 2)))
            if 16 * (b + 1) <= n:
                w = (so >> 2) + 4 * b
                v = (do >> 2) + 4 * b
                dst32[v] = np.uint32(src32[w] ^ k0)
                dst32[v + 1] = np.uint32(src32[w + 1] ^ k1)
                dst32[v + 2] = np.uint32(src32[w + 2] ^ k2)
                dst32[v + 3] = np.uint32(src32[w + 3] ^ k3)
            else:
                for i in range(n - 16 * b):
                    q = i >> 2
                    kw = k0
                    if q == 1:
                        kw = k1
                    elif q == 2:
                        kw = k2
                    elif q == 3:
                        kw = k3
                    dst8[do + 16 * b + i] = np.uint8((src8[so + 16 * b + i] ^ (kw >> (8 * (i & 3)))) & 0xFF)


@kernel
def ghash_segments_kernel(htab_g: Any, aad32: Any, aad8: Any, aad_off: Any, aad_len: Any, ct32: Any, ct8: Any,
                          ct_off: Any, ct_len: Any, cum: Any, nchunks: Any, bps: Any, out: Any) -> None:
    """Level 0 of GHASH: the partial sum of each segment of ``bps`` blocks of a chunk's GHASH input
    (AAD, ciphertext, lengths block), by Horner's rule with H's nibble tables (in shared memory).
    Segments are right-aligned (zero blocks in front), so every segment ends an exact multiple of
    ``bps`` blocks before the chunk's end and the joins below need only powers H^(2^j)."""
    htab = cuda.shared.array(HTAB_WORDS, np.uint32)
    for i in range(cuda.threadIdx.x, HTAB_WORDS, cuda.blockDim.x):
        htab[i] = htab_g[i]
    cuda.syncthreads()
    for seg in range(cuda.grid(1), cum[nchunks], cuda.gridsize(1)):
        c = find_chunk(cum, nchunks, seg)
        la = aad_len[c]
        lc = ct_len[c]
        na = (la + 15) >> 4
        nc = (lc + 15) >> 4
        pad = (cum[c + 1] - cum[c]) * bps - (na + nc + 1)
        v0 = (seg - cum[c]) * bps
        a0 = np.uint32(0)
        a1 = np.uint32(0)
        a2 = np.uint32(0)
        a3 = np.uint32(0)
        for v in range(v0, v0 + bps):
            i = v - pad
            if i < 0:
                continue
            if i < na:
                x0, x1, x2, x3 = load_block(aad32, aad8, aad_off[c], la, i)
            elif i < na + nc:
                x0, x1, x2, x3 = load_block(ct32, ct8, ct_off[c], lc, i - na)
            else:  # lengths block: BE64(bits of AAD) || BE64(bits of ciphertext)
                x0 = bswap(np.uint32(la >> 29))
                x1 = bswap(np.uint32((la << 3) & ALL_ONES))
                x2 = bswap(np.uint32(lc >> 29))
                x3 = bswap(np.uint32((lc << 3) & ALL_ONES))
            a0, a1, a2, a3 = table_mul(htab, np.uint32(a0 ^ x0), np.uint32(a1 ^ x1), np.uint32(a2 ^ x2),
                                       np.uint32(a3 ^ x3))
        out[4 * seg] = a0
        out[4 * seg + 1] = a1
        out[4 * seg + 2] = a2
        out[4 * seg + 3] = a3


@kernel
def ghash_join_kernel(pows: Any, pow_index: Any, src: Any, src_cum: Any, dst_cum: Any, nchunks: Any, fan: Any,
                      out: Any) -> None:
    """One join level: each output partial is ``fan`` consecutive input partials of one chunk joined by
    Horner's rule with H^(input segment length) = ``pows[pow_index]`` (right-aligned like level 0)."""
    p0 = pows[4 * pow_index]
    p1 = pows[4 * pow_index + 1]
    p2 = pows[4 * pow_index + 2]
    p3 = pows[4 * pow_index + 3]
    for g in range(cuda.grid(1), dst_cum[nchunks], cuda.gridsize(1)):
        c = find_chunk(dst_cum, nchunks, g)
        nin = src_cum[c + 1] - src_cum[c]
        pad = (dst_cum[c + 1] - dst_cum[c]) * fan - nin
        u0 = (g - dst_cum[c]) * fan
        a0 = np.uint32(0)
        a1 = np.uint32(0)
        a2 = np.uint32(0)
        a3 = np.uint32(0)
        for u in range(u0, u0 + fan):
            i = u - pad
            if i < 0:
                continue
            if (a0 | a1 | a2 | a3) != 0:
                a0, a1, a2, a3 = gf_mul(a0, a1, a2, a3, p0, p1, p2, p3)
            s = 4 * (src_cum[c] + i)
            a0 = np.uint32(a0 ^ src[s])
            a1 = np.uint32(a1 ^ src[s + 1])
            a2 = np.uint32(a2 ^ src[s + 2])
            a3 = np.uint32(a3 ^ src[s + 3])
        out[4 * g] = a0
        out[4 * g + 1] = a1
        out[4 * g + 2] = a2
        out[4 * g + 3] = a3


@kernel
def tag_kernel(te: Any, rk: Any, nonces: Any, ghash: Any, nchunks: Any, tags: Any, verify: Any, ok: Any) -> None:
    """tag = E(K, J0) XOR GHASH, J0 = nonce || 0x00000001. Sealing (``verify == 0``) writes the tags;
    opening compares them with the given ones without an early exit and sets ``ok[c]``."""
    for c in range(cuda.grid(1), nchunks, cuda.gridsize(1)):
        e0, e1, e2, e3 = aes_block(te, 1, 0, rk, nonces[3 * c], nonces[3 * c + 1], nonces[3 * c + 2],
                                   np.uint32(0x01000000))
        t0 = np.uint32(e0 ^ ghash[4 * c])
        t1 = np.uint32(e1 ^ ghash[4 * c + 1])
        t2 = np.uint32(e2 ^ ghash[4 * c + 2])
        t3 = np.uint32(e3 ^ ghash[4 * c + 3])
        if verify == 0:
            tags[4 * c] = t0
            tags[4 * c + 1] = t1
            tags[4 * c + 2] = t2
            tags[4 * c + 3] = t3
            ok[c] = 1
        else:
            diff = (t0 ^ tags[4 * c]) | (t1 ^ tags[4 * c + 1]) | (t2 ^ tags[4 * c + 2]) | (t3 ^ tags[4 * c + 3])
            ok[c] = 1 if diff == 0 else 0
