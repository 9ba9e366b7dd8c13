"""Per-hop AES-256-GCM of the ring: the AAD packer, the hop cipher states and where crypto runs.

Every hop of the ring is sealed by its sender and opened by its receiver with a key of its own
(one per directed link, from an authenticated handshake; see ``keys``). The nonce is the key's
4-byte prefix || a 64-bit counter. Both ends walk the same deterministic schedule, so a receiver
knows the exact counter and AAD it expects: a replayed, reordered or misrouted chunk fails its tag.

``HostCrypto`` is the one place that decides where the crypto runs: host threads today (the
``cryptography`` AES-GCM releases the GIL), a GPU kernel later.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.core.errors import ConfigError, NonceExhaustedError
from gputravel.core.procs import name_os_thread
from gputravel.core.protocol import TAG_LEN, DirectionKey, TagError, nonce
from gputravel.core.protocol.cipher import COUNTER_MAX

__all__ = [
    "ALL_RANKS",
    "TAG_LEN",
    "HopAad",
    "HopOpener",
    "HopSealer",
    "HostCrypto",
    "Phase",
    "default_workers",
    "rejected",
]

ALL_RANKS = 0xFFFF
"""``dst`` of a chunk sealed once under the ring-wide key and forwarded to every rank."""


class Phase(IntEnum):
    """Which half of the ring a hop belongs to (part of every AAD)."""

    REDUCE_SCATTER = 1
    ALL_GATHER = 2
    GATHER_SEALED = 3  # all-gather, sealed once by the chunk's owner under the ring-wide key
    DIRECT = 4  # world 2: each rank's whole tensor in one step, one hop or chunk-sized hops (``direct``)


_HOP_AAD = struct.Struct(">8s16sQQBHIHHQQ")
_HOP_LABEL = b"gtring-1"


@dataclass(frozen=True, slots=True)
class HopAad:
    """Everything a hop's tag binds besides the ciphertext."""

    session_id: bytes  # 16 bytes: the link's session (or the ring's gather session)
    epoch: int
    iteration: int  # collective call number on this ring
    phase: int
    step: int  # ring step within the phase
    chunk: int
    src: int  # rank that sealed
    dst: int  # rank that opens (ALL_RANKS for a ring-wide sealed chunk)
    offset: int  # byte offset of the plaintext in the flattened tensor
    length: int  # plaintext bytes

    def pack(self) -> bytes:
        """The one AAD packing of ring hops."""
        return _HOP_AAD.pack(_HOP_LABEL, self.session_id, self.epoch, self.iteration, self.phase, self.step,
                             self.chunk, self.src, self.dst, self.offset, self.length)


class _HopState:
    __slots__ = ("_aead", "key", "prefix", "epoch", "session_id", "fingerprint", "counter")

    def __init__(self, key: DirectionKey, *, session_id: bytes) -> None:
        if len(session_id) != 16:
            raise ConfigError("a ring session id is 16 bytes")
        self._aead = AESGCM(key.key)
        self.key = key  # the GPU cipher builds its own key schedule from it (gpu_ring)
        self.prefix = key.prefix
        self.epoch = key.epoch
        self.session_id = session_id
        self.fingerprint = key.fingerprint
        self.counter = 0  # next unreserved sequence number

    def reserve(self, n: int) -> int:
        """Reserve ``n`` consecutive sequence numbers and return the first (never handed out twice)."""
        if n < 0:
            raise ConfigError("cannot reserve a negative count")
        base = self.counter
        if base + n > COUNTER_MAX:
            raise NonceExhaustedError(f"ring key {self.fingerprint} used all its nonces; re-key the ring")
        self.counter = base + n
        return base

    def __repr__(self) -> str:
        return f"{type(self).__name__}(epoch={self.epoch}, fp={self.fingerprint}, counter={self.counter})"


class HopSealer(_HopState):
    """The sealing end of one directed link (or of one owner's ring-wide gather key)."""

    __slots__ = ()

    def seal_into(self, seq: int, plaintext: Any, out: Any, aad: HopAad) -> None:
        """Seal ``plaintext`` into ``out`` (``len + 16`` bytes). ``seq`` must come from ``reserve``."""
        self._aead.encrypt_into(nonce(self.prefix, seq), plaintext, aad.pack(), out)


class HopOpener(_HopState):
    """The opening end: the counter mirrors the sender's, so the expected nonce is exact."""

    __slots__ = ()

    def open_into(self, seq: int, ciphertext: Any, out: Any, aad: HopAad) -> None:
        """Verify and decrypt into ``out``; on a bad tag ``out`` is zeroed and ``TagError`` raised."""
        try:
            self._aead.decrypt_into(nonce(self.prefix, seq), ciphertext, aad.pack(), out)
        except InvalidTag:
            memoryview(out).cast("B")[:] = bytes(len(memoryview(out).cast("B")))
            raise rejected(aad) from None

    def decryptor(self, seq: int, aad: HopAad) -> Any:
        """The hop ``seal_into`` sealed, opened piece by piece (``streamed.open_add``): ``update_into`` each piece, then
        ``finalize_with_tag``, which raises ``InvalidTag`` on a bad tag (the pieces already released are then
        unauthenticated: the caller's call fails and zeroes its tensor)."""
        dec = Cipher(algorithms.AES(self.key.key), modes.GCM(nonce(self.prefix, seq))).decryptor()
        dec.authenticate_additional_data(aad.pack())
        return dec


def rejected(aad: HopAad) -> TagError:
    """The error of a hop whose tag did not verify."""
    return TagError(f"ring hop rejected: rank {aad.dst} could not authenticate iteration {aad.iteration} "
                    f"phase {Phase(aad.phase).name} step {aad.step} chunk {aad.chunk} from rank {aad.src}")


def default_workers(local_world_size: int | None = None) -> int:
    """Crypto threads per rank: the cores left free by the ranks on this node (0: crypto runs inline on the
    issuing thread, overlapping only the wire, which is best when every core already runs a rank)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores // max(1, local_world_size) - 1)


class HostCrypto:
    """Where a ring's crypto runs: a pool of host threads (AES-GCM releases the GIL).

    Ciphertext always lives in host buffers here; the ring stages device tensors through pinned host
    memory (see ``ring``). A GPU AES-GCM kernel would replace this class and nothing else. With
    ``workers=0`` every task runs inline, on the thread that issues the sends and receives.
    """

    __slots__ = ("workers", "_pool")

    def __init__(self, *, workers: int) -> None:
        if workers < 0:
            raise ConfigError("workers must be >= 0")
        self.workers = workers  # threads that seal, open and reduce chunks (0: inline)
        self._pool: ThreadPoolExecutor | None = None  # started on first use

    @property
    def inline(self) -> bool:
        return self.workers == 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self.workers == 0:
            fut: Future[Any] = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # surfaces from result(), as with a pool
                fut.set_exception(exc)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ring-crypto",
                                            initializer=name_os_thread)
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"HostCrypto(workers={self.workers})"


def timed(fn: Callable[[], None]) -> float:
    """Run ``fn`` and return the seconds it took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
