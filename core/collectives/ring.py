"""The ring all-reduce (reduce-scatter, then all-gather) on ``torch.distributed`` point-to-point ops.

One ``SecureRing`` per process group runs every ``Variant``, so a benchmark is a loop over the enum.
Rank r sends to ``right = r+1`` and receives from ``left = r-1``. With W ranks the flat tensor is cut
into W segments; in reduce-scatter step s rank r sends segment ``r-s`` and adds segment ``r-s-1``
into its own copy; in all-gather step s it sends segment ``r+1-s`` and stores segment ``r-s``.

Secure variants seal every hop with the link key of (r -> right) and open with (left -> r); the AAD
binds (iteration, phase, step, chunk, src, dst, offset, length). A bad tag never returns: the
receiving rank raises ``TagError``, every other rank ``CollectiveAbortedError``, and the tensor is
zeroed on every rank (one tiny status at the end of each secure call decides: ``agree``; at world 2 on gloo one
4-byte message each way, elsewhere a 4-byte all-reduce). At world 2 with no free core, both secure variants send a
tensor up to ``DIRECT_MAX_BYTES`` as one sealed hop each way (``direct.run_direct``, ``Phase.DIRECT``): the same
bytes sealed and opened, one message fewer; above it naive's schedule (for ``secure_pipelined``, the same step in
hops of ``DIRECT_CHUNK_BYTES`` where ``DIRECT_CHUNKED`` is set).

Here: the variants, the plans' cache, the plaintext ring and the agreement; one secure call's schedules and
buffers are ``secure_call``'s, the building blocks ``parts``', the GPU-cipher variant ``gpu_ring``'s.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from enum import StrEnum
from functools import cache

import torch
import torch.distributed as dist

from gputravel.core.collectives.agree import all_reduce_status, exchange_status
from gputravel.core.collectives.crypto import HostCrypto, default_workers
from gputravel.core.collectives.direct import run_direct
from gputravel.core.collectives.keys import RingKeys
from gputravel.core.collectives.parts import RingFault, RingPlan, RingStats, Wire
from gputravel.core.collectives.secure_call import RingBuffers, SecureCall
from gputravel.core.errors import CollectiveAbortedError, CollectiveError, ConfigError, GpuTravelError
from gputravel.core.protocol import TagError

__all__ = [
    "DIRECT_CHUNKED",
    "DIRECT_CHUNK_BYTES",
    "DIRECT_MAX_BYTES",
    "CollectiveAbortedError",
    "RingFault",
    "RingStats",
    "SecureRing",
    "Variant",
    "available_variants",
    "gloo_tls_available",
]

DEFAULT_CHUNK_BYTES = 1 << 20
#: at world 2 with no chunking (no free core), both secure variants send a tensor up to this size as one sealed
#: hop each way (``direct.run_direct``) instead of the ring's two steps: the same bytes sealed, sent and opened,
#: one message and one wake-up fewer (``secure_naive`` too since session 13, docs/collectives.md). 4 MiB: one gloo
#: message (``parts.WIRE_PIECE_BYTES``), and a reused scratch of at most that size for the peer's opened tensor.
DIRECT_MAX_BYTES = 4 << 20
#: above ``DIRECT_MAX_BYTES`` the same world-2 case still sends each rank's whole tensor in one step, cut into hops
#: of this size, each sealed, sent and opened on its own, so sealing hop k+1 overlaps hop k on the wire and each hop
#: opens into a reused, cache-resident scratch before its add (``direct.run_direct``; measured in
#: docs/collectives.md, "The direct schedule at 64 MiB").
DIRECT_CHUNK_BYTES = 4 << 20
#: whether the direct schedule runs above ``DIRECT_MAX_BYTES`` (in ``DIRECT_CHUNK_BYTES`` hops). Off since session 12:
#: there naive's two-step schedule (whole-hop seal, 1 MiB wire pieces, open + add in cached pieces) was the faster,
#: 101-104 ms against 111-116 at 64 MiB in two alternated bench pairs (docs/collectives.md), so ``secure_pipelined``
#: at world 2 with no free core runs naive's schedule above 4 MiB. Tests turn it on to keep the chunked path honest.
DIRECT_CHUNKED = False


class Variant(StrEnum):
    """Every way this project can all-reduce; benchmarks and the DDP hook loop over it."""

    NOOP = "noop"  # no communication at all: the headroom
    PLAIN = "plain"  # dist.all_reduce
    RING = "ring"  # our ring, plaintext
    SECURE_NAIVE = "secure_naive"  # per hop, serially: seal, send, receive, open, reduce (the TEE baseline; world 2:
    # up to DIRECT_MAX_BYTES one hop each way)
    SECURE_PIPELINED = "secure_pipelined"  # chunked, crypto on a pool overlapping the wire
    GLOO_TLS = "gloo_tls"  # dist.all_reduce on gloo's TCP_TLS transport, where the build has it
    SECURE_GPU = "secure_gpu"  # per hop: seal on the GPU, send ciphertext, open + reduce on the GPU (gpu_ring)

    @property
    def secure(self) -> bool:
        return self in (Variant.SECURE_NAIVE, Variant.SECURE_PIPELINED, Variant.SECURE_GPU)


@cache
def gloo_tls_available() -> bool:
    """Whether this torch build's gloo has the TCP_TLS transport (torch 2.13's CPU wheel has not)."""
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    saved = os.environ.get("GLOO_DEVICE_TRANSPORT")
    os.environ["GLOO_DEVICE_TRANSPORT"] = "TCP_TLS"
    try:
        dist.ProcessGroupGloo.create_default_device()
        return True
    except RuntimeError:
        return False
    finally:
        if saved is None:
            del os.environ["GLOO_DEVICE_TRANSPORT"]
        else:
            os.environ["GLOO_DEVICE_TRANSPORT"] = saved


def available_variants() -> tuple[Variant, ...]:
    """Every variant this build can run (``gloo_tls`` only where detected; ``secure_gpu`` only where the GPU
    cipher has a CUDA device: elsewhere it runs in numba's simulator, for tests, when named)."""
    from gputravel.core.gpucipher.backend import gpu_cipher_on_cuda

    return tuple(v for v in Variant if (v is not Variant.GLOO_TLS or gloo_tls_available())
                 and (v is not Variant.SECURE_GPU or gpu_cipher_on_cuda()))


class SecureRing:
    """All-reduce (sum, in place) over one process group with any ``Variant``."""

    __slots__ = ("group", "rank", "world", "keys", "crypto", "chunk_bytes", "sealed_gather", "fault",
                 "stats", "iteration", "wire", "_plans", "_tls_group", "_scratch")

    def __init__(self, *, group: dist.ProcessGroup | None = None, keys: RingKeys | None,
                 crypto: HostCrypto | None = None, chunk_bytes: int | None = None,
                 sealed_gather: bool = True, fault: RingFault | None = None) -> None:
        if not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialized")
        if chunk_bytes is not None and chunk_bytes < 4096:
            raise ConfigError("chunk_bytes must be at least 4096")
        self.group = group  # None: the default group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if keys is not None and (keys.rank, keys.world) != (self.rank, self.world):
            raise ConfigError(f"keys are for rank {keys.rank}/{keys.world}, group has {self.rank}/{self.world}")
        self.keys = keys  # None: plaintext variants only
        self.crypto = crypto or HostCrypto(workers=default_workers())  # where sealing, opening, reducing run
        self.chunk_bytes = chunk_bytes  # pipelined chunk size; None: auto (see pipeline_chunk)
        self.sealed_gather = sealed_gather  # all-gather forwards chunks sealed once under the ring-wide key
        self.fault = fault  # fault injection (tests, demos); None in production
        self.stats: dict[Variant, RingStats] = {}  # per variant
        self.iteration = 0  # secure calls so far (in every AAD)
        self.wire = Wire(group, self.rank, self.world)
        self._plans: OrderedDict[tuple[int, int, int | None], tuple[RingPlan, RingBuffers | None]] = OrderedDict()
        self._tls_group: dist.ProcessGroup | None = None
        self._scratch: torch.Tensor | None = None  # the plaintext ring's receive scratch (``_scratch_for``)

    def close(self) -> None:
        self.crypto.close()
        self._plans.clear()
        self._scratch = None

    def pipeline_chunk(self) -> int | None:
        """The pipelined chunk size. Auto: 1 MiB where crypto threads have free cores; one chunk per
        segment (naive's schedule) where every core already runs a rank, because there the wire is CPU
        work too (measured on 2 cores, loopback gloo: chunking only added per-message cost)."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return DEFAULT_CHUNK_BYTES if self.crypto.workers > 0 else None

    def all_reduce(self, tensor: torch.Tensor, variant: Variant | str = Variant.SECURE_PIPELINED) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it."""
        variant = Variant(variant)
        stats = self.stats.setdefault(variant, RingStats())
        t0 = time.perf_counter()
        try:
            if variant is Variant.NOOP or self.world == 1 or tensor.numel() == 0:
                pass
            elif variant is Variant.PLAIN:
                dist.all_reduce(tensor, group=self.group)
                stats.wire_s += time.perf_counter() - t0
            elif variant is Variant.GLOO_TLS:
                dist.all_reduce(tensor, group=self._gloo_tls())
                stats.wire_s += time.perf_counter() - t0
            else:
                self._ring(tensor, variant, stats)
        except GpuTravelError:
            raise
        except RuntimeError as exc:  # the process group's own failure: a peer's socket closed, or its timeout
            tensor.zero_()
            raise CollectiveError(
                f"rank {self.rank}: the {variant.value} all-reduce lost its link: "
                f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}; a peer rank died or was "
                "stopped (see the other ranks' output); nothing of this call was applied") from exc
        stats.calls += 1
        stats.wall_s += time.perf_counter() - t0
        return tensor

    # --- plumbing ----------------------------------------------------------------------------------
    def _gloo_tls(self) -> dist.ProcessGroup:
        if not gloo_tls_available():
            raise CollectiveError("gloo_tls: this torch build's gloo has no TCP_TLS transport")
        if self._tls_group is None:
            saved = os.environ.get("GLOO_DEVICE_TRANSPORT")
            os.environ["GLOO_DEVICE_TRANSPORT"] = "TCP_TLS"  # key/cert/CA come from GLOO_DEVICE_TRANSPORT_TCP_TLS_*
            try:
                self._tls_group = dist.new_group(backend="gloo")
            finally:
                if saved is None:
                    os.environ.pop("GLOO_DEVICE_TRANSPORT", None)
                else:
                    os.environ["GLOO_DEVICE_TRANSPORT"] = saved
        return self._tls_group

    def _plan(self, numel: int, esize: int, chunk_bytes: int | None, *, secure: bool,
              pin: bool) -> tuple[RingPlan, RingBuffers | None]:
        key = (numel, esize, chunk_bytes)
        hit = self._plans.get(key)
        if hit is None or (secure and hit[1] is None):
            plan = RingPlan.make(world=self.world, numel=numel, esize=esize, chunk_bytes=chunk_bytes)
            hit = (plan, RingBuffers(plan, self.rank, pin=pin) if secure else None)
            self._plans[key] = hit
            while len(self._plans) > 8:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return hit

    def _ring(self, tensor: torch.Tensor, variant: Variant, stats: RingStats) -> None:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        host = work
        # crypto runs on host threads (see HostCrypto), except secure_gpu's, which runs where the tensor is
        staged = variant.secure and work.is_cuda and variant is not Variant.SECURE_GPU
        if staged:
            host = torch.empty(work.shape, dtype=work.dtype, pin_memory=True)
            host.copy_(work)
        flat = host.view(-1)
        try:
            if variant is Variant.RING:
                self._plain_ring(flat, stats)
            else:
                self._secure(flat, variant, stats)
        finally:
            if staged:
                work.copy_(host)
            if work is not tensor:
                tensor.copy_(work)

    # --- plaintext ring ----------------------------------------------------------------------------
    def _plain_ring(self, flat: torch.Tensor, stats: RingStats) -> None:
        plan, _ = self._plan(flat.numel(), flat.element_size(), None, secure=False, pin=False)
        b = plan.seg_bounds
        biggest = max(b[i + 1] - b[i] for i in range(self.world))
        scratch = self._scratch_for(biggest, flat)
        wire = self.wire
        for g in range(2 * self.world - 2):
            si, ri = plan.seg(g, self.rank, send=True), plan.seg(g, self.rank, send=False)
            send = flat[b[si]:b[si + 1]]
            n = b[ri + 1] - b[ri]
            rs = g < self.world - 1
            dst = scratch[:n] if rs else flat[b[ri]:b[ri + 1]]
            t0 = time.perf_counter()
            sw, rw = wire.exchange(send if send.numel() else None, dst if n else None, tag=g)
            for w in (sw, rw):
                if w is not None:
                    w.wait()
            t1 = time.perf_counter()
            stats.wire_s += t1 - t0
            if rs and n:
                flat[b[ri]:b[ri + 1]].add_(dst)
                stats.reduce_s += time.perf_counter() - t1

    def _scratch_for(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The plaintext ring's receive scratch, reused across calls: a fresh 32 MiB tensor every call was
        faulted in page by page by the kernel's copy (2x that step's wire time at 64 MiB, docs/collectives.md)."""
        s = self._scratch
        if s is None or s.dtype != like.dtype or s.device != like.device or s.numel() < numel:
            s = self._scratch = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    # --- secure ring -------------------------------------------------------------------------------
    def _secure(self, flat: torch.Tensor, variant: Variant, stats: RingStats) -> None:
        keys = self.keys
        if keys is None:
            raise ConfigError(f"variant {variant} needs ring keys (establish_ring_keys)")
        if variant is Variant.SECURE_GPU:
            from gputravel.core.collectives.gpu_ring import gpu_secure_all_reduce

            try:
                error = gpu_secure_all_reduce(self, flat, keys, stats)
            finally:
                self.iteration += 1
            self._agree(flat, error)
            return
        chunk = self.pipeline_chunk() if variant is Variant.SECURE_PIPELINED else None
        # With no free core (auto chunking off) and two ranks there is nothing to pipeline on another core and no
        # forwarding hop, so there both secure variants run the direct schedule up to DIRECT_MAX_BYTES: each rank's
        # whole tensor as one sealed hop each way (the same bytes sealed, sent and opened as the ring's two steps;
        # one step); above it naive's schedule, unless secure_pipelined and DIRECT_CHUNKED (hops of
        # DIRECT_CHUNK_BYTES).
        small = flat.numel() * flat.element_size() <= DIRECT_MAX_BYTES
        direct = (chunk is None and self.world == 2 and not self.wire.nccl
                  and (small or (variant is Variant.SECURE_PIPELINED and DIRECT_CHUNKED)))
        pipelined = variant is Variant.SECURE_PIPELINED and not (chunk is None and self.world == 2)
        plan, bufs = self._plan(flat.numel(), flat.element_size(), DIRECT_CHUNK_BYTES if direct else chunk,
                                secure=True, pin=torch.cuda.is_available() and self.wire.nccl)
        assert bufs is not None
        job = SecureCall(self, self.crypto, plan, bufs, flat, keys, sealed=self.sealed_gather and self.world > 2,
                          stats=stats)
        try:
            if direct:
                run_direct(job, max_bytes=DIRECT_MAX_BYTES, chunk_bytes=DIRECT_CHUNK_BYTES)
            elif pipelined:
                job.run_pipelined()
            else:
                job.run_naive()
        finally:
            self.iteration += 1
        try:
            self._agree(flat, job.error)
        finally:
            job.finish()

    def _agree(self, flat: torch.Tensor, error: TagError | None) -> None:
        """Every rank learns whether any rank rejected a hop; on a rejection no rank keeps its result (``agree``:
        at world 2 on gloo one status message each way, else a 4-byte all-reduce)."""
        mine = self.rank + 1 if error is not None else 0
        if self.world == 2 and not self.wire.nccl:
            bad = exchange_status(mine, group=self.group, peer=self.wire.right)
        else:
            bad = all_reduce_status(mine, group=self.group, device=self.wire.device)
        if bad:
            flat.zero_()
            if error is not None:
                raise error
            raise CollectiveAbortedError(f"rank {bad - 1} rejected a ring hop (iteration {self.iteration - 1}); "
                                         f"the all-reduce was aborted on rank {self.rank}")
