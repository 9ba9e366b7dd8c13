"""Open and reduce in one pass: AES-256-CTR decryption fused with a float32 sum (secure ring hops).

A ring all-reduce hop received during reduce-scatter is opened and then added into the receiver's
segment. Two passes (decrypt into a scratch buffer, then add it) write the plaintext to device memory
and read it back; this kernel adds each decrypted word straight into the destination, so the plaintext
of a hop never exists outside registers. The tag check runs first (``GpuAesGcm.open_add_f32_device``)
and only chunks whose tag verified are added, as with ``ctr_kernel``.

Import through ``GpuAesGcm`` (the backend must be fixed first, see ``backend.kernels``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gputravel.core.gpucipher.kernels import LANES, TABLE_WORDS, aes_block, bswap, cuda, find_chunk, kernel


@kernel
def ctr_add_f32_kernel(te: Any, rk_g: Any, nonces: Any, src32: Any, src_off: Any, dstf: Any, dst_off: Any,
                       nbytes: Any, cum: Any, nchunks: Any, bpt: Any, ok: Any) -> None:
    """``dstf[dst_off/4 + j] += float32(bits of plaintext word j)`` for every chunk whose ``ok`` is set;
    plaintext word j = ciphertext word j XOR the CTR keystream (block b: E(K, nonce || BE32(2 + b))).
    Chunk lengths are multiples of 4 bytes; ``dst_off`` needs 4-byte alignment only."""
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
        so = src_off[c] >> 2
        do = dst_off[c] >> 2
        for b in range(b0, b1):
            k0, k1, k2, k3 = aes_block(tab, LANES, lane, rk, n0, n1, n2, bswap(np.uint32(b + 2)))
            w = so + 4 * b
            v = do + 4 * b
            words = min(4, (n >> 2) - 4 * b)
            if words == 4:
                dstf[v] += np.uint32(src32[w] ^ k0).view(np.float32)
                dstf[v + 1] += np.uint32(src32[w + 1] ^ k1).view(np.float32)
                dstf[v + 2] += np.uint32(src32[w + 2] ^ k2).view(np.float32)
                dstf[v + 3] += np.uint32(src32[w + 3] ^ k3).view(np.float32)
            else:
                for i in range(words):
                    kw = k0
                    if i == 1:
                        kw = k1
                    elif i == 2:
                        kw = k2
                    dstf[v + i] += np.uint32(src32[w + i] ^ kw).view(np.float32)
