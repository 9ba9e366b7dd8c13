"""One secure all-reduce on the CPU ring: its schedule (naive or pipelined), sequence numbers, buffers and the
first error seen (``SecureCall``), and the preallocated ciphertext it seals into and opens from (``RingBuffers``).

``ring.SecureRing`` owns the plans, the keys' counters between calls and the final agreement; a ``SecureCall``
lives for one call. The AAD of every hop and the schedule are ``ring``'s module docstring's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch

from gputravel.core.collectives.crypto import (
    ALL_RANKS,
    TAG_LEN,
    HopAad,
    HopOpener,
    HopSealer,
    HostCrypto,
    Phase,
)
from gputravel.core.collectives.keys import RingKeys
from gputravel.core.collectives.parts import RingPlan, RingStats, RingView
from gputravel.core.collectives.streamed import OPEN_PIECE_BYTES, open_add
from gputravel.core.protocol import TagError

__all__ = ["NAIVE_PIECE_BYTES", "RingBuffers", "SecureCall"]

#: naive's wire pieces (``Wire.exchange``'s ``piece_bytes``, the same cut on both ends of a hop). Measured at 64 MiB,
#: world 2, gloo, the 2-core Xeon, naive's calls interleaved in one run (docs/collectives.md, session 12): median
#: ms with pieces of 256 KiB 105.7, 512 KiB 101.6, 1 MiB 100.2, 2 MiB 108.9, 4 MiB (``WIRE_PIECE_BYTES``) 107.8.
NAIVE_PIECE_BYTES = 1 << 20


class RingBuffers:
    """Preallocated ciphertext (and reduce scratch) of one plan on one rank, reused across calls."""

    __slots__ = ("send_off", "recv_off", "send", "recv", "send_np", "recv_np", "scratch", "scratch_np",
                 "saved", "piece")

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
        self.piece: torch.Tensor | None = None  # open + add scratch, naive's and direct's (made on first use)

    def piece_scratch(self) -> torch.Tensor:
        if self.piece is None:
            self.piece = torch.empty(OPEN_PIECE_BYTES + TAG_LEN, dtype=torch.uint8)
        return self.piece


class SecureCall:
    """One secure all-reduce: its schedule, sequence numbers, buffers and the first error seen."""

    def __init__(self, ring: RingView, crypto: HostCrypto, plan: RingPlan, bufs: RingBuffers, flat: torch.Tensor, keys: RingKeys, *,
                 sealed: bool, stats: RingStats) -> None:
        self.ring, self.crypto, self.plan, self.bufs, self.keys, self.stats = ring, crypto, plan, bufs, keys, stats
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
        self.pending: list[Any] = []  # sends left to wait on after the agreement (``direct.run_direct``)
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

    def _seal_args(self, g: int, k: int) -> tuple[HopSealer, int, HopAad, Any]:
        """Who seals this rank's outgoing chunk k of global step g: (sealer, sequence number, AAD, plaintext)."""
        plan, esize = self.plan, self.plan.esize
        a, b = plan.chunks[plan.seg(g, self.rank, send=True)][k]
        phase, step = self._phase_step(g)
        pt = self.flat_np[a * esize:b * esize]  # type: ignore[index]
        if self._gathered(g):
            aad = HopAad(self.keys.gather_seal.session_id, self.keys.epoch, self.iteration, Phase.GATHER_SEALED,
                         0, k, self.rank, ALL_RANKS, a * esize, (b - a) * esize)
            return self.keys.gather_seal, self.gather_base + k, aad, pt
        aad = HopAad(self.keys.send.session_id, self.keys.epoch, self.iteration, phase, step, k, self.rank,
                     self.right, a * esize, (b - a) * esize)
        return self.keys.send, self.send_base + g * plan.maxc + k, aad, pt

    def _seal(self, g: int, k: int) -> float:
        """Seal this rank's outgoing chunk k of global step g; returns seconds spent."""
        t0 = time.perf_counter()
        sealer, seq, aad, pt = self._seal_args(g, k)
        sealer.seal_into(seq, pt, self._send_ct(g, k), aad)
        return time.perf_counter() - t0

    def _open_args(self, g: int, k: int) -> tuple[HopOpener, int, HopAad]:
        """Who opens chunk k received at global step g: (opener, sequence number, AAD)."""
        plan, esize = self.plan, self.plan.esize
        seg = plan.seg(g, self.rank, send=False)
        a, b = plan.chunks[seg][k]
        phase, step = self._phase_step(g)
        if self._gathered(g):
            owner = (seg - 1) % self.world
            opener = self.keys.gather_open[owner]
            aad = HopAad(opener.session_id, self.keys.epoch, self.iteration, Phase.GATHER_SEALED, 0, k, owner,
                         ALL_RANKS, a * esize, (b - a) * esize)
            return opener, self.gather_base + k, aad
        opener = self.keys.recv
        aad = HopAad(opener.session_id, self.keys.epoch, self.iteration, phase, step, k, self.left,
                     self.rank, a * esize, (b - a) * esize)
        return opener, self.recv_base + g * plan.maxc + k, aad

    def _open(self, g: int, k: int, out: Any) -> TagError | None:
        opener, seq, aad = self._open_args(g, k)
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

    def note(self, err: TagError | None) -> None:
        if err is not None and self.error is None:
            self.error = err

    def inject(self, g: int, k: int, out: torch.Tensor,
                hops: tuple[tuple[Phase, int], ...] | None = None) -> torch.Tensor:
        """Fault injection: the bytes a tampering or replaying host would deliver instead of ``out``. ``hops``:
        the (phase, step) pairs this message carries (default: global step g's)."""
        fault = self.ring.fault
        if fault is None or fault.rank != self.rank:
            return out
        if k != fault.chunk or (fault.phase, fault.step) not in (hops or (self._phase_step(g),)):
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
        return self.inject(g, k, out) if inject else out

    def _recv_tensor(self, g: int, k: int) -> torch.Tensor:
        a, b = self.plan.chunks[self.plan.seg(g, self.rank, send=False)][k]
        off = self.bufs.recv_off[g][k]
        return self.bufs.recv[off:off + (b - a) * self.plan.esize + TAG_LEN]

    def _counts(self, g: int) -> tuple[int, int]:
        plan = self.plan
        return (len(plan.chunks[plan.seg(g, self.rank, send=True)]),
                len(plan.chunks[plan.seg(g, self.rank, send=False)]))

    # the three schedules
    def finish(self) -> None:
        """Wait on the sends left pending (after the call's agreement; their buffers are reused next call)."""
        while self.pending:
            self.pending.pop().wait()

    def run_naive(self) -> None:
        """Per hop, serially, in this thread: seal, send, receive, open (+ reduce). On the wire in pieces of
        ``NAIVE_PIECE_BYTES``; each reduce-scatter hop is opened and added piece by piece (``streamed.open_add``)."""
        st, wire, bufs = self.stats, self.ring.wire, self.bufs
        for g in range(2 * self.world - 2):
            nsend, nrecv = self._counts(g)
            if nsend and not (self._gathered(g) and g > self.world - 1):
                st.crypto_s += self._seal(g, 0)
                st.bytes_sealed += self._send_tensor(g, 0).numel() - TAG_LEN
            t0 = time.perf_counter()
            sw, rw = wire.exchange(self._send_tensor(g, 0, inject=True) if nsend else None,
                                   self._recv_tensor(g, 0) if nrecv else None, tag=g, piece_bytes=NAIVE_PIECE_BYTES)
            for w in (sw, rw):
                if w is not None:
                    w.wait()
            st.wire_s += time.perf_counter() - t0
            if nrecv:
                plan, esize = self.plan, self.plan.esize
                a, b = plan.chunks[plan.seg(g, self.rank, send=False)][0]
                t1 = time.perf_counter()
                err: TagError | None = None
                adding = 0.0
                if g < self.world - 1:
                    opener, seq, aad = self._open_args(g, 0)
                    try:
                        adding = open_add(opener, seq, aad, self._recv_ct(g, 0), self.flat_t[a:b], bufs.piece_scratch(),
                                          piece_bytes=OPEN_PIECE_BYTES)
                    except TagError as exc:
                        err = exc
                else:
                    err = self._open(g, 0, self.flat_np[a * esize:b * esize])  # type: ignore[index]
                st.crypto_s += time.perf_counter() - t1 - adding
                st.reduce_s += adding
                st.bytes_opened += (b - a) * esize
                self.note(err)

    def run_pipelined(self) -> None:
        """Chunks: the pool seals chunk k+1 while chunk k is on the wire, and opens (+ reduces, + re-seals
        for the next step) each chunk as it lands; this thread only posts sends and receives."""
        st, wire, pool = self.stats, self.ring.wire, self.crypto
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
        self.note(err)
