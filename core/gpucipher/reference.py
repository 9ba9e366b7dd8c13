"""Host-side pieces of the GPU cipher: AES tables, the AES-256 key schedule and GF(2^128) arithmetic.

Everything here runs once per key (or once per process) on the host and is uploaded to the device: the
kernels only read tables. Words are little-endian views of 4 bytes in memory order (``word = b0 | b1<<8 |
b2<<16 | b3<<24``), so a kernel can load 16 plaintext bytes as four 32-bit words without byte swaps.
Field elements use GCM's convention: the 16 bytes read as one big-endian 128-bit integer whose most
significant bit is the coefficient of x^0.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

U32 = npt.NDArray[np.uint32]

#: GCM's reduction constant: x^128 = 1 + x + x^2 + x^7 in the reflected bit order.
GCM_R = 0xE1 << 120
#: Highest power index 2^j of H kept on the device (H^(2^j), j < POW_COUNT): enough for any batch.
POW_COUNT = 48


def _xtime(b: int) -> int:
    b <<= 1
    return (b ^ 0x11B) & 0xFF if b & 0x100 else b


def _gf8_mul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a = _xtime(a)
        b >>= 1
    return r


def _make_sbox() -> list[int]:
    exp = [0] * 510
    log = [0] * 256
    x = 1
    for i in range(255):  # 3 generates GF(2^8)*: inverses from log/antilog tables
        exp[i] = exp[i + 255] = x
        log[x] = i
        x = _gf8_mul(x, 3)
    inv = [0] + [exp[255 - log[a]] for a in range(1, 256)]
    box = []
    for a in range(256):
        x = inv[a]
        s = x
        for _ in range(4):
            x = ((x << 1) | (x >> 7)) & 0xFF
            s ^= x
        box.append(s ^ 0x63)
    return box


SBOX: tuple[int, ...] = tuple(_make_sbox())


def te0_le() -> U32:
    """The one encryption T-table in little-endian form: ``2S | S<<8 | S<<16 | 3S<<24``.

    The other three classic tables are its rotations by 8, 16 and 24 bits, and S itself is byte 1 of an
    entry, so the kernel keeps one 1 KiB table (replicated per shared-memory bank)."""
    out = np.empty(256, dtype=np.uint32)
    for x, s in enumerate(SBOX):
        s2 = _xtime(s)
        out[x] = s2 | (s << 8) | (s << 16) | ((s2 ^ s) << 24)
    return out


def expand_key_le(key: bytes) -> U32:
    """AES-256 key schedule: 60 round-key words, each the little-endian view of its 4 bytes."""
    if len(key) != 32:
        raise ValueError(f"AES-256 needs a 32-byte key, got {len(key)} bytes")
    w = [int.from_bytes(key[4 * i:4 * i + 4], "big") for i in range(8)]
    rcon = 1
    for i in range(8, 60):
        t = w[i - 1]
        if i % 8 == 0:
            t = ((t << 8) | (t >> 24)) & 0xFFFFFFFF
            t = (SBOX[t >> 24] << 24) | (SBOX[(t >> 16) & 0xFF] << 16) | (SBOX[(t >> 8) & 0xFF] << 8) | SBOX[t & 0xFF]
            t ^= rcon << 24
            rcon = _xtime(rcon)
        elif i % 8 == 4:
            t = (SBOX[t >> 24] << 24) | (SBOX[(t >> 16) & 0xFF] << 16) | (SBOX[(t >> 8) & 0xFF] << 8) | SBOX[t & 0xFF]
        w.append(w[i - 8] ^ t)
    return np.array([int.from_bytes(x.to_bytes(4, "big"), "little") for x in w], dtype=np.uint32)


def aes_encrypt_block(round_keys_le: U32, block: bytes) -> bytes:
    """One AES-256 block on the host, with the same table formulation as the kernel (tests and H)."""
    te = [int(v) for v in te0_le()]
    rk = [int(v) for v in round_keys_le]

    def rotl(v: int, n: int) -> int:
        return ((v << n) | (v >> (32 - n))) & 0xFFFFFFFF

    s = [int.from_bytes(block[4 * i:4 * i + 4], "little") ^ rk[i] for i in range(4)]
    for r in range(1, 14):
        s = [te[s[j] & 0xFF] ^ rotl(te[(s[(j + 1) & 3] >> 8) & 0xFF], 8)
             ^ rotl(te[(s[(j + 2) & 3] >> 16) & 0xFF], 16) ^ rotl(te[s[(j + 3) & 3] >> 24], 24) ^ rk[4 * r + j]
             for j in range(4)]
    out = [SBOX[s[j] & 0xFF] | (SBOX[(s[(j + 1) & 3] >> 8) & 0xFF] << 8)
           | (SBOX[(s[(j + 2) & 3] >> 16) & 0xFF] << 16) | (SBOX[s[(j + 3) & 3] >> 24] << 24) for j in range(4)]
    return b"".join((out[j] ^ rk[56 + j]).to_bytes(4, "little") for j in range(4))


def gf_mul(x: int, y: int) -> int:
    """Multiply two GCM field elements (128-bit integers read big-endian from their 16 bytes)."""
    z = 0
    v = y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            z ^= v
        v = (v >> 1) ^ GCM_R if v & 1 else v >> 1
    return z


def element_words(e: int) -> list[int]:
    """A field element as the four little-endian words of its 16 bytes."""
    b = e.to_bytes(16, "big")
    return [int.from_bytes(b[4 * i:4 * i + 4], "little") for i in range(4)]


def nibble_tables(h: int) -> U32:
    """Tables for multiplying by ``h``: entry [k][v] (4 words) is ``X * h`` where X has nibble k = v.

    Nibble k of a block is ``(word[k >> 3] >> 4 * (k & 7)) & 15``, so a product is the XOR of 32
    entries chosen by the nibbles of X: multiplication is linear over GF(2). 32*16*4 words = 8 KiB."""
    out = np.zeros((32, 16, 4), dtype=np.uint32)
    for k in range(32):
        byte = k >> 1
        shift = 4 * (k & 1)
        basis = [gf_mul((1 << bit) << shift << (8 * (15 - byte)), h) for bit in range(4)]
        for v in range(1, 16):
            acc = 0
            for bit in range(4):
                if (v >> bit) & 1:
                    acc ^= basis[bit]
            out[k, v] = element_words(acc)
    return out.reshape(-1)


def power_table(h: int) -> U32:
    """``H^(2^j)`` for j < POW_COUNT, 4 words each: the multipliers that join GHASH partial sums."""
    out = np.zeros((POW_COUNT, 4), dtype=np.uint32)
    p = h
    for j in range(POW_COUNT):
        out[j] = element_words(p)
        p = gf_mul(p, p)
    return out.reshape(-1)


def ghash(h: int, aad: bytes, ct: bytes) -> int:
    """Reference GHASH over AAD, ciphertext and the lengths block (tests)."""
    def blocks(data: bytes) -> list[int]:
        padded = data + b"\0" * (-len(data) % 16)
        return [int.from_bytes(padded[i:i + 16], "big") for i in range(0, len(padded), 16)]

    y = 0
    for x in [*blocks(aad), *blocks(ct), ((len(aad) * 8) << 64) | (len(ct) * 8)]:
        y = gf_mul(y ^ x, h)
    return y
