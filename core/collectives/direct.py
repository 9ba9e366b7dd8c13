"""The direct schedule of a secure all-reduce at world 2: each rank sends its whole tensor to the other, sealed.

Used by ``ring.SecureRing`` at world 2 on gloo with no free core (nothing to pipeline on another core, no forwarding
hop): by ``secure_pipelined``, and by ``secure_naive`` up to ``ring.DIRECT_MAX_BYTES`` (session 13). Each rank
seals, sends and opens the same bytes as in the ring's two steps (its tensor's size once each way), in one step
instead of two; it adds the whole peer tensor (x0 + x1 on one rank, x1 + x0 on the other: the same bits as
``dist.all_reduce``). Up to ``max_bytes`` the tensor is one hop each way; above,
hops of ``chunk_bytes``, so sealing hop k+1 overlaps hop k on the wire. Each hop is opened piece by piece into
one small reused scratch and each piece added while it is in the cache (``streamed.open_add``).

Hop i covers elements [a, b): AAD ``Phase.DIRECT``, step 0, chunk i, src -> dst, byte offset a, length; nonce: the
link's sequence number ``base + i`` of those the call reserved (``2 * plan.maxc``, at least the hop count when the
plan's chunk is ``chunk_bytes``). A ``RingFault`` at step 0 of either phase, or at ``Phase.DIRECT``, hits the hop
its ``chunk`` names.
"""

from __future__ import annotations

import time

from gputravel.core.collectives.crypto import TAG_LEN, HopAad, Phase
from gputravel.core.collectives.secure_call import SecureCall
from gputravel.core.collectives.streamed import open_add
from gputravel.core.errors import CollectiveError
from gputravel.core.protocol import TagError

__all__ = ["direct_hops", "run_direct"]

_FAULTED = ((Phase.DIRECT, 0), (Phase.REDUCE_SCATTER, 0), (Phase.ALL_GATHER, 0))


def direct_hops(job: SecureCall, *, max_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The hops' element ranges, cutting the whole tensor in order: one up to ``max_bytes``, else ``chunk_bytes``
    each (the plan's chunk, so never more hops than the nonces reserved)."""
    numel, esize = job.plan.numel, job.plan.esize
    if numel * esize <= max_bytes:
        return [(0, numel)]
    per = max(1, chunk_bytes // esize)
    hops = [(a, min(a + per, numel)) for a in range(0, numel, per)]
    if len(hops) > 2 * job.plan.maxc or job.world != 2:
        raise CollectiveError(f"direct schedule: {len(hops)} hops but {2 * job.plan.maxc} nonces reserved "
                              f"(world {job.world})")
    return hops


def run_direct(job: SecureCall, *, max_bytes: int, chunk_bytes: int) -> None:
    """Post every receive; seal and send hop i while earlier hops travel, opening and adding each peer hop that
    has landed (and whose range this rank has sealed already); then wait for the rest in order. The sends are
    waited on after the call's agreement (``SecureCall.finish``): by then the peer has opened them."""
    st, wire, bufs, keys, esize = job.stats, job.ring.wire, job.bufs, job.keys, job.plan.esize
    flat_np = job.flat_np
    if flat_np is None:
        raise CollectiveError("direct schedule: empty tensor")
    peer = 1 - job.rank
    hops = direct_hops(job, max_bytes=max_bytes, chunk_bytes=chunk_bytes)
    cts = [(a * esize + TAG_LEN * i, (b - a) * esize + TAG_LEN) for i, (a, b) in enumerate(hops)]  # i tags before
    t0 = time.perf_counter()
    recvs = [wire.exchange(None, bufs.recv[o:o + n], tag=i)[1] for i, (o, n) in enumerate(cts)]
    spent = {"wire": time.perf_counter() - t0, "crypto": 0.0, "reduce": 0.0}
    opened = 0

    def open_hop(i: int) -> None:
        a, b = hops[i]
        o, n = cts[i]
        t1 = time.perf_counter()
        recvs[i].wait()
        t2 = time.perf_counter()
        scratch = bufs.piece_scratch()  # opened piece by piece, each added while in the cache (``streamed``)
        aad = HopAad(keys.recv.session_id, keys.epoch, job.iteration, Phase.DIRECT, 0, i, peer, job.rank, a * esize,
                     (b - a) * esize)
        err: TagError | None = None
        adding = 0.0
        try:
            adding = open_add(keys.recv, job.recv_base + i, aad, bufs.recv_np[o:o + n], job.flat_t[a:b], scratch)
        except TagError as exc:
            err = exc
        t3 = time.perf_counter() - adding
        job.note(err)
        spent["wire"] += t2 - t1
        spent["crypto"] += t3 - t2
        spent["reduce"] += time.perf_counter() - t3

    for i, (a, b) in enumerate(hops):
        o, n = cts[i]
        t1 = time.perf_counter()
        aad = HopAad(keys.send.session_id, keys.epoch, job.iteration, Phase.DIRECT, 0, i, job.rank, peer, a * esize,
                     (b - a) * esize)
        keys.send.seal_into(job.send_base + i, flat_np[a * esize:b * esize], bufs.send_np[o:o + n], aad)
        t2 = time.perf_counter()
        sw, _ = wire.exchange(job.inject(-1, i, bufs.send[o:o + n], _FAULTED), None, tag=i)
        job.pending.append(sw)
        spent["crypto"] += t2 - t1
        spent["wire"] += time.perf_counter() - t2
        while opened <= i and recvs[opened].done():  # landed, and its range already sealed here: open, add
            open_hop(opened)
            opened += 1
    while opened < len(hops):
        open_hop(opened)
        opened += 1
    st.wire_s += spent["wire"]
    st.crypto_s += spent["crypto"]
    st.reduce_s += spent["reduce"]
    st.bytes_sealed += job.plan.numel * esize
    st.bytes_opened += job.plan.numel * esize
