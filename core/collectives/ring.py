"""The ring all-reduce (reduce-scatter, then all-gather) on ``torch.distributed`` point-to-point ops.

One ``SecureRing`` per process group runs every ``Variant``, so a benchmark is a loop over the enum.
Rank r sends to ``right = r+1`` and receives from ``left = r-1``. With W ranks the flat tensor is cut
into W segments; in reduce-scatter step s rank r sends segment ``r-s`` and adds segment ``r-s-1``
into its own copy; in all-gather step s it sends segment ``r+1-s`` and stores segment ``r-s``.

Secure variants seal every hop with the link key of (r -> right) and open with (left -> r); the AAD
binds (iteration, phase, step, chunk, src, dst, offset, length). A bad tag never returns: the
receiving rank raises ``TagError``, every other rank ``CollectiveAbortedError``, and the tensor is
zeroed on every rank (one tiny status all-reduce at the end of each secure call decides).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from concurrent.futures import Future
from enum import StrEnum
from functools import cache
from typing import Any

import torch
import torch.distributed as dist

from gputravel.core.collectives.crypto import (
    ALL_RANKS,
    TAG_LEN,
    HopAad,
    HopOpener,
    HostCrypto,
    Phase,
    default_workers,
)
from gputravel.core.collectives.keys import RingKeys
from gputravel.core.collectives.parts import RingFault, RingPlan, RingStats, Wire
from gputravel.core.errors import CollectiveAbortedError, CollectiveError, ConfigError
from gputravel.core.protocol import TagError

__all__ = [
    "CollectiveAbortedError",
    "RingFault",
    "RingStats",
    "SecureRing",
    "Variant",
    "available_variants",
    "gloo_tls_available",
]

DEFAULT_CHUNK_BYTES = 1 << 20


class Variant(StrEnum):
    """Every way this project can all-reduce; benchmarks and the DDP hook loop over it."""

    NOOP = "noop"  # no communication at all: the headroom
    PLAIN = "plain"  # dist.all_reduce
    RING = "ring"  # our ring, plaintext
    SECURE_NAIVE = "secure_naive"  # per hop, serially: seal, send, receive, open, reduce (the TEE baseline)
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


class _Buffers:
    """Preallocated ciphertext (and reduce scratch) of one plan on one rank, reused across calls."""

    __slots__ = ("send_off", "recv_off", "send", "recv", "send_np", "recv_np", "scratch", "scratch_np",
                 "saved")

    def __init__(self, plan: RingPlan, rank: int, *, pin: bool) -> None:
        self.send_off, send_total = plan.layout(rank, send=True)
        self.recv_off, recv_total = plan.layout(rank, send=False)
        self.send = torch.empty(send_total, dtype=torch.uint8, pin_memory=pin)
        self.recv = torch.empty(recv_total, dtype=torch.uint8, pin_memory=pin)
        self.send_np = self.send.numpy()
        self.recv_np = self.recv.numpy()
        biggest = max((b - a) for seg in plan.chunks for a, b in seg) if plan.numel else 0
        self.scratch = torch.empty((plan.maxc, max(1, biggest) * plan.esize), dtype=torch.uint8)
        self.scratch_np = self.scratch.numpy()
        self.saved: dict[tuple[int, int], bytes] = {}  # replay fault: first call's ciphertext


class SecureRing:
    """All-reduce (sum, in place) over one process group with any ``Variant``."""

    __slots__ = ("group", "rank", "world", "keys", "crypto", "chunk_bytes", "sealed_gather", "fault",
                 "stats", "iteration", "wire", "_plans", "_tls_group")

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
        self._plans: OrderedDict[tuple[int, int, int | None], tuple[RingPlan, _Buffers | None]] = OrderedDict()
        self._tls_group: dist.ProcessGroup | None = None

    def close(self) -> None:
        self.crypto.close()
        self._plans.clear()

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
              pin: bool) -> tuple[RingPlan, _Buffers | None]:
        key = (numel, esize, chunk_bytes)
        hit = self._plans.get(key)
        if hit is None or (secure and hit[1] is None):
            plan = RingPlan.make(world=self.world, numel=numel, esize=esize, chunk_bytes=chunk_bytes)
            hit = (plan, _Buffers(plan, self.rank, pin=pin) if secure else None)
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
        scratch = torch.empty(biggest, dtype=flat.dtype, device=flat.device)
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
        plan, bufs = self._plan(flat.numel(), flat.element_size(), chunk, secure=True,
                                pin=torch.cuda.is_available() and self.wire.nccl)
        assert bufs is not None
        job = _SecureCall(self, plan, bufs, flat, keys, sealed=self.sealed_gather and self.world > 2,
                          stats=stats)
        # With no free core (auto chunking off) and two ranks there is nothing to pipeline: no core to overlap
        # on, and no forwarding hop for eager forwarding or the sealed gather. Pre-posting receives alone
        # measured 2-4% slower than naive's schedule (bench allreduce, world 2, 16/64 MiB, 15 repeats), so the
        # pipelined variant runs that schedule there and is never the slower of the two.
        pipelined = variant is Variant.SECURE_PIPELINED and not (chunk is None and self.world == 2)
        try:
            if pipelined:
                job.run_pipelined()
            else:
                job.run_naive()
        finally:
            self.iteration += 1
        self._agree(flat, job.error)

    def _agree(self, flat: torch.Tensor, error: TagError | None) -> None:
        """Every rank learns whether any rank rejected a hop; on a rejection no rank keeps its result."""
        flag = torch.tensor([self.rank + 1 if error is not None else 0], dtype=torch.int32,
                            device=self.wire.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        bad = int(flag.item())
        if bad:
            flat.zero_()
            if error is not None:
                raise error
            raise CollectiveAbortedError(f"rank {bad - 1} rejected a ring hop (iteration {self.iteration - 1}); "
                                         f"the all-reduce was aborted on rank {self.rank}")


class _SecureCall:
    """One secure all-reduce: its schedule, sequence numbers, buffers and the first error seen."""

    def __init__(self, ring: SecureRing, plan: RingPlan, bufs: _Buffers, flat: torch.Tensor, keys: RingKeys, *,
                 sealed: bool, stats: RingStats) -> None:
        self.ring, self.plan, self.bufs, self.keys, self.stats = ring, plan, bufs, keys, stats
        self.rank, self.world = ring.rank, ring.world
        self.flat_t = flat
        self.flat_np = flat.view(torch.uint8).numpy() if flat.numel() else None
        self.sealed = sealed
        self.iteration = ring.iteration
        steps = 2 * self.world - 2
        # Reserve this call's nonces the same way on every rank, whatever happens below.
        self.send_base = keys.send.reserve(steps * plan.maxc)
        self.recv_base = keys.recv.reserve(steps * plan.maxc)
        self.gather_base = keys.gather_seal.reserve(plan.maxc)
        for opener in keys.gather_open:
            opener.reserve(plan.maxc)
        self.error: TagError | None = None
        self.left, self.right = (self.rank - 1) % self.world, (self.rank + 1) % self.world

    # schedule helpers
    def _phase_step(self, g: int) -> tuple[Phase, int]:
        w = self.world
        return (Phase.REDUCE_SCATTER, g) if g < w - 1 else (Phase.ALL_GATHER, g - (w - 1))

    def _send_ct(self, g: int, k: int) -> Any:
        a, b = self.plan.chunks[self.plan.seg(g, self.rank, send=True)][k]
        off = self.bufs.send_off[g][k]
        return self.bufs.send_np[off:off + (b - a) * self.plan.esize + TAG_LEN]

    def _recv_ct(self, g: int, k: int) -> Any:
        a, b = self.plan.chunks[self.plan.seg(g, self.rank, send=False)][k]
        off = self.bufs.recv_off[g][k]
        return self.bufs.recv_np[off:off + (b - a) * self.plan.esize + TAG_LEN]

    def _gathered(self, g: int) -> bool:
        """Whether the hop at global step g travels sealed under its owner's ring-wide key."""
        return self.sealed and g >= self.world - 1

    def _seal(self, g: int, k: int) -> float:
        """Seal this rank's outgoing chunk k of global step g; returns seconds spent."""
        plan, esize = self.plan, self.plan.esize
        a, b = plan.chunks[plan.seg(g, self.rank, send=True)][k]
        phase, step = self._phase_step(g)
        t0 = time.perf_counter()
        pt = self.flat_np[a * esize:b * esize]  # type: ignore[index]
        if self._gathered(g):
            aad = HopAad(self.keys.gather_seal.session_id, self.keys.epoch, self.iteration, Phase.GATHER_SEALED,
                         0, k, self.rank, ALL_RANKS, a * esize, (b - a) * esize)
            self.keys.gather_seal.seal_into(self.gather_base + k, pt, self._send_ct(g, k), aad)
        else:
            aad = HopAad(self.keys.send.session_id, self.keys.epoch, self.iteration, phase, step, k, self.rank,
                         self.right, a * esize, (b - a) * esize)
            self.keys.send.seal_into(self.send_base + g * plan.maxc + k, pt, self._send_ct(g, k), aad)
        return time.perf_counter() - t0

    def _open(self, g: int, k: int, out: Any) -> TagError | None:
        plan, esize = self.plan, self.plan.esize
        seg = plan.seg(g, self.rank, send=False)
        a, b = plan.chunks[seg][k]
        phase, step = self._phase_step(g)
        opener: HopOpener
        if self._gathered(g):
            owner = (seg - 1) % self.world
            opener = self.keys.gather_open[owner]
            aad = HopAad(opener.session_id, self.keys.epoch, self.iteration, Phase.GATHER_SEALED, 0, k, owner,
                         ALL_RANKS, a * esize, (b - a) * esize)
            seq = self.gather_base + k
        else:
            opener = self.keys.recv
            aad = HopAad(opener.session_id, self.keys.epoch, self.iteration, phase, step, k, self.left,
                         self.rank, a * esize, (b - a) * esize)
            seq = self.recv_base + g * plan.maxc + k
        try:
            opener.open_into(seq, self._recv_ct(g, k), out, aad)
        except TagError as exc:
            return exc
        return None

    def _task(self, g: int, k: int) -> tuple[float, float, TagError | None]:
        """Open chunk k received at step g, reduce or store it, and seal it for step g+1 when it goes on."""
        plan, esize = self.plan, self.plan.esize
        a, b = plan.chunks[plan.seg(g, self.rank, send=False)][k]
        nbytes = (b - a) * esize
        t0 = time.perf_counter()
        reduce_s = 0.0
        if g < self.world - 1:
            scratch = self.bufs.scratch_np[k][:nbytes]
            err = self._open(g, k, scratch)
            t1 = time.perf_counter()
            crypto = t1 - t0
            if err is None:
                src = self.bufs.scratch[k][:nbytes].view(self.flat_t.dtype)
                self.flat_t[a:b].add_(src)
                reduce_s = time.perf_counter() - t1
        else:
            err = self._open(g, k, self.flat_np[a * esize:b * esize])  # type: ignore[index]
            crypto = time.perf_counter() - t0
        last = 2 * self.world - 3
        if g < last and not (self._gathered(g) and self._gathered(g + 1)):
            crypto += self._seal(g + 1, k)
        return crypto, reduce_s, err

    def _note(self, err: TagError | None) -> None:
        if err is not None and self.error is None:
            self.error = err

    def _inject(self, g: int, k: int, out: torch.Tensor) -> torch.Tensor:
        """Fault injection: the bytes a tampering or replaying host would deliver instead of ``out``."""
        fault = self.ring.fault
        if fault is None or fault.rank != self.rank:
            return out
        phase, step = self._phase_step(g)
        if (phase, step, k) != (fault.phase, fault.step, fault.chunk):
            return out
        if fault.kind == "flip":
            out = out.clone()  # never touch the buffer this rank still opens
            out[out.numel() // 2] ^= 0x01
        elif (g, k) in self.bufs.saved:
            out = torch.frombuffer(bytearray(self.bufs.saved[(g, k)]), dtype=torch.uint8)
        else:
            self.bufs.saved[(g, k)] = out.numpy().tobytes()
        return out

    def _send_tensor(self, g: int, k: int, *, inject: bool = False) -> torch.Tensor:
        """The bytes that go out at (g, k): sealed here, or the received chunk forwarded as it came."""
        plan = self.plan
        if self._gathered(g) and g > self.world - 1:
            a, b = plan.chunks[plan.seg(g - 1, self.rank, send=False)][k]
            off = self.bufs.recv_off[g - 1][k]
        else:
            a, b = plan.chunks[plan.seg(g, self.rank, send=True)][k]
            off = self.bufs.send_off[g][k]
        out = (self.bufs.recv if self._gathered(g) and g > self.world - 1 else self.bufs.send)
        out = out[off:off + (b - a) * plan.esize + TAG_LEN]
        return self._inject(g, k, out) if inject else out

    def _recv_tensor(self, g: int, k: int) -> torch.Tensor:
        a, b = self.plan.chunks[self.plan.seg(g, self.rank, send=False)][k]
        off = self.bufs.recv_off[g][k]
        return self.bufs.recv[off:off + (b - a) * self.plan.esize + TAG_LEN]

    def _counts(self, g: int) -> tuple[int, int]:
        plan = self.plan
        return (len(plan.chunks[plan.seg(g, self.rank, send=True)]),
                len(plan.chunks[plan.seg(g, self.rank, send=False)]))

    # the two schedules
    def run_naive(self) -> None:
        """Per hop, serially, in this thread: seal, send, receive, open (+ reduce)."""
        st, wire = self.stats, self.ring.wire
        for g in range(2 * self.world - 2):
            nsend, nrecv = self._counts(g)
            if nsend and not (self._gathered(g) and g > self.world - 1):
                st.crypto_s += self._seal(g, 0)
                st.bytes_sealed += self._send_tensor(g, 0).numel() - TAG_LEN
            t0 = time.perf_counter()
            sw, rw = wire.exchange(self._send_tensor(g, 0, inject=True) if nsend else None,
                                   self._recv_tensor(g, 0) if nrecv else None, tag=g)
            for w in (sw, rw):
                if w is not None:
                    w.wait()
            st.wire_s += time.perf_counter() - t0
            if nrecv:
                plan, esize = self.plan, self.plan.esize
                a, b = plan.chunks[plan.seg(g, self.rank, send=False)][0]
                t1 = time.perf_counter()
                if g < self.world - 1:
                    err = self._open(g, 0, self.bufs.scratch_np[0][:(b - a) * esize])
                    t2 = time.perf_counter()
                    if err is None:
                        self.flat_t[a:b].add_(self.bufs.scratch[0][:(b - a) * esize].view(self.flat_t.dtype))
                    st.reduce_s += time.perf_counter() - t2
                else:
                    err = self._open(g, 0, self.flat_np[a * esize:b * esize])  # type: ignore[index]
                    t2 = time.perf_counter()
                st.crypto_s += t2 - t1
                st.bytes_opened += (b - a) * esize
                self._note(err)

    def run_pipelined(self) -> None:
        """Chunks: the pool seals chunk k+1 while chunk k is on the wire, and opens (+ reduces, + re-seals
        for the next step) each chunk as it lands; this thread only posts sends and receives."""
        st, wire, pool = self.stats, self.ring.wire, self.ring.crypto
        steps, maxc = 2 * self.world - 2, self.plan.maxc
        nsend0, _ = self._counts(0)
        # With a pool, step 0's chunks are all queued now; inline, each is sealed just before it is sent.
        ready: dict[int, Future[Any]] = ({} if pool.inline else
                                         {k: pool.submit(self._seal_only, 0, k) for k in range(nsend0)})
        accounted: set[Future[Any]] = set()  # holds them: an id() could be reused
        tasks: list[Future[Any]] = []
        sends: list[Any] = []
        sent_early: set[int] = set()  # chunks of the next step already sent (inline)

        def post_recvs(g: int) -> list[Any]:
            return [wire.exchange(None, self._recv_tensor(g, k), tag=g * maxc + k)[1]
                    for k in range(self._counts(g)[1])]

        next_recvs = post_recvs(0) if not wire.nccl else []
        for g in range(steps):
            nsend, nrecv = self._counts(g)
            if wire.nccl:  # one ordered stream of grouped (send, recv) pairs
                recvs = []
                for k in range(max(nsend, nrecv)):
                    if g == 0 and pool.inline and k < nsend:
                        ready[k] = pool.submit(self._seal_only, 0, k)
                    self._wait_ready(ready.get(k), accounted)
                    send_t = self._send_tensor(g, k, inject=True) if k < nsend else None
                    sw, rw = wire.exchange(send_t, self._recv_tensor(g, k) if k < nrecv else None, tag=0)
                    if sw is not None:
                        sends.append(sw)
                    recvs.append(rw)
            else:  # gloo: receives posted a step ahead, each send as soon as its chunk is sealed
                recvs = next_recvs
                next_recvs = post_recvs(g + 1) if g + 1 < steps else []
                for k in range(nsend):
                    if k in sent_early:
                        continue
                    if g == 0 and pool.inline:
                        ready[k] = pool.submit(self._seal_only, 0, k)
                    self._wait_ready(ready.get(k), accounted)
                    sends.append(wire.exchange(self._send_tensor(g, k, inject=True), None, tag=g * maxc + k)[0])
            st.bytes_sealed += sum(self._send_tensor(g, k).numel() - TAG_LEN for k in range(nsend))
            forward = self._gathered(g) and self._gathered(g + 1)
            eager = pool.inline and not wire.nccl and g + 1 < steps
            sent_early = set()
            nxt: dict[int, Future[Any]] = {}
            for k in range(nrecv):
                t0 = time.perf_counter()
                recvs[k].wait()
                st.wire_s += time.perf_counter() - t0
                st.bytes_opened += self._recv_tensor(g, k).numel() - TAG_LEN
                fut = pool.submit(self._task, g, k)
                tasks.append(fut)
                if not forward:
                    nxt[k] = fut
                if eager:  # inline: chunk k goes on to the right at once, while chunk k+1 arrives
                    self._wait_ready(nxt.get(k), accounted)
                    sends.append(wire.exchange(self._send_tensor(g + 1, k, inject=True), None,
                                               tag=(g + 1) * maxc + k)[0])
                    sent_early.add(k)
            ready = nxt
        t0 = time.perf_counter()
        for fut in tasks:
            if fut not in accounted:
                self._account(fut.result())
        t1 = time.perf_counter()
        st.wait_s += t1 - t0
        for sw in sends:
            sw.wait()
        st.wire_s += time.perf_counter() - t1

    def _wait_ready(self, fut: Future[Any] | None, accounted: set[Future[Any]]) -> None:
        if fut is None:
            return
        t0 = time.perf_counter()
        result = fut.result()
        self.stats.wait_s += time.perf_counter() - t0
        if fut not in accounted:
            accounted.add(fut)
            self._account(result)

    def _seal_only(self, g: int, k: int) -> tuple[float, float, None]:
        return self._seal(g, k), 0.0, None

    def _account(self, result: tuple[float, float, TagError | None]) -> None:
        crypto, reduce_s, err = result
        self.stats.crypto_s += crypto
        self.stats.reduce_s += reduce_s
        self._note(err)
