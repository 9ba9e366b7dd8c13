"""The ring's building blocks, shared by the CPU ring (``ring``) and the GPU-cipher ring (``gpu_ring``).

``RingPlan`` cuts one flat tensor into segments and chunks and lays out every hop's ciphertext;
``Wire`` issues the point-to-point ops; ``RingStats`` adds up where the seconds went; ``RingFault``
injects a tampering or replaying host; ``RingView`` is what a variant's implementation reads of the ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gputravel.core.collectives.crypto import TAG_LEN, Phase
from gputravel.core.errors import ConfigError

__all__ = ["WIRE_PIECE_BYTES", "RingFault", "RingPlan", "RingStats", "RingView", "StagedRecv", "Wire", "WireWork",
           "piece_ranges"]

#: the largest message the gloo wire sends as one: a bigger one goes as pieces of this size (at most
#: ``MAX_PIECES`` of them), each its own isend/irecv, all posted at once. Measured on the 2-core build machine,
#: loopback gloo, 2 ranks exchanging 32 MiB each way twice (one reduce-scatter and one all-gather step at 64
#: MiB): as one message 244 ms (best of 7), as 4 MiB pieces 66 ms, 1 MiB 82 ms, 8 MiB 72 ms, while gloo's own
#: all_reduce of the 64 MiB took 100 ms. The cipher's chunks are not touched: this is the wire's cut only.
WIRE_PIECE_BYTES = 4 << 20
MAX_PIECES = 64


@dataclass(frozen=True, slots=True)
class RingFault:
    """Fault injection for tests and demos: rank ``rank`` corrupts the hop it sends at (phase, step, chunk).

    ``flip`` flips one ciphertext byte (a tampering host); ``replay`` sends, from the second call on,
    the ciphertext it sent for that hop in the first call (a replaying host). Under the direct schedule (world
    2, small tensor: one hop each way) a fault at step 0, chunk 0 of either phase, or at ``Phase.DIRECT``, hits
    that one hop.
    """

    kind: str
    rank: int
    phase: Phase = Phase.REDUCE_SCATTER
    step: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("flip", "replay"):
            raise ConfigError("fault kind is 'flip' or 'replay'")


@dataclass(slots=True)
class RingStats:
    """Seconds by where they went, summed over calls. Crypto and reduce run on the pool, so the parts of a
    pipelined variant overlap and may add up to more than ``wall_s``."""

    calls: int = 0
    wall_s: float = 0.0
    crypto_s: float = 0.0  # sealing and opening (all threads)
    reduce_s: float = 0.0  # adding received chunks (all threads)
    wire_s: float = 0.0  # the issuing thread blocked on send/recv completion
    wait_s: float = 0.0  # the issuing thread blocked on the crypto pool
    bytes_sealed: int = 0
    bytes_opened: int = 0

    def reset(self) -> None:
        for f in ("calls", "wall_s", "crypto_s", "reduce_s", "wire_s", "wait_s", "bytes_sealed", "bytes_opened"):
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in ("calls", "wall_s", "crypto_s", "reduce_s", "wire_s", "wait_s",
                                              "bytes_sealed", "bytes_opened")}


@dataclass(slots=True)
class RingPlan:
    """Segments and chunks of one flat tensor, and the ciphertext layout of every hop (by global step)."""

    world: int
    numel: int
    esize: int
    seg_bounds: list[int]  # element bounds of the W segments
    chunks: list[list[tuple[int, int]]]  # per segment: element ranges of its chunks
    maxc: int
    ct_offsets: list[list[int]] = field(default_factory=list)  # per global step: byte offset of each chunk's ct
    ct_total: int = 0

    @classmethod
    def make(cls, *, world: int, numel: int, esize: int, chunk_bytes: int | None) -> RingPlan:
        bounds = [(i * numel) // world for i in range(world + 1)]
        per = max(1, (chunk_bytes or (numel * esize + 1)) // esize)
        chunks = []
        for i in range(world):
            a, b = bounds[i], bounds[i + 1]
            chunks.append([(x, min(x + per, b)) for x in range(a, b, per)])
        maxc = max(1, max(len(c) for c in chunks))
        return cls(world, numel, esize, bounds, chunks, maxc)

    def seg(self, g: int, rank: int, *, send: bool) -> int:
        w = self.world
        if g < w - 1:  # reduce-scatter step g
            return (rank - g - (0 if send else 1)) % w
        s = g - (w - 1)
        return (rank + 1 - s - (0 if send else 1)) % w

    def layout(self, rank: int, *, send: bool) -> tuple[list[list[int]], int]:
        offsets, total = [], 0
        for g in range(2 * self.world - 2):
            row = []
            for a, b in self.chunks[self.seg(g, rank, send=send)]:
                row.append(total)
                total += (b - a) * self.esize + TAG_LEN
            offsets.append(row)
        return offsets, total


class Wire:
    """Issues every point-to-point op from one thread, in one order on every rank.

    gloo: ``isend``/``irecv`` with a tag per (step, chunk). NCCL: ciphertext is staged through device
    uint8 buffers and each send is grouped with its receive (``batch_isend_irecv``).
    """

    __slots__ = ("group", "left", "right", "nccl", "device")

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
        self.group = group
        self.left = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self.right = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, tag: int, *,
                 piece_bytes: int = WIRE_PIECE_BYTES) -> tuple[Any, Any]:
        """Post a send to the right and a receive from the left; returns (send work, recv work). On gloo a
        message over ``piece_bytes`` travels as pieces (``piece_ranges``: the same cut on both ends, a hop's send
        and receive have one length), each tagged ``tag * MAX_PIECES + piece``."""
        if self.nccl:
            return self._exchange_nccl(send, recv)
        sw = WireWork([dist.isend(p, self.right, group=self.group, tag=tag * MAX_PIECES + i)
                       for i, p in enumerate(_pieces(send, piece_bytes))]) if send is not None else None
        rw = WireWork([dist.irecv(p, self.left, group=self.group, tag=tag * MAX_PIECES + i)
                       for i, p in enumerate(_pieces(recv, piece_bytes))]) if recv is not None else None
        return sw, rw

    def _exchange_nccl(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> tuple[Any, Any]:
        ops, dev_recv = [], None
        if send is not None:
            dev_send = send if send.is_cuda else send.to(self.device, non_blocking=True)
            ops.append(dist.P2POp(dist.isend, dev_send, self.right, self.group))
        if recv is not None:
            dev_recv = recv if recv.is_cuda else torch.empty_like(recv, device=self.device)
            ops.append(dist.P2POp(dist.irecv, dev_recv, self.left, self.group))
        works = dist.batch_isend_irecv(ops) if ops else []
        sw = works[0] if send is not None and works else None
        rw = works[-1] if recv is not None and works else None
        if rw is not None and dev_recv is not None and not recv.is_cuda:  # type: ignore[union-attr]
            return sw, StagedRecv(rw, dev_recv, recv)  # type: ignore[arg-type]
        return sw, rw


def piece_ranges(nbytes: int, piece_bytes: int = WIRE_PIECE_BYTES, *, align: int = 1) -> list[tuple[int, int]]:
    """The wire's cut of an ``nbytes`` message, as (byte offset, length): one piece up to ``piece_bytes``, else
    pieces of ``piece_bytes`` (larger, if that would make over ``MAX_PIECES``; a multiple of ``align``, the
    element size), the last one shorter."""
    if nbytes <= piece_bytes:
        return [(0, nbytes)]
    piece = max(piece_bytes, -(-nbytes // MAX_PIECES)) // align * align
    return [(o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]


def _pieces(t: torch.Tensor, piece_bytes: int = WIRE_PIECE_BYTES) -> tuple[torch.Tensor, ...]:
    """``t`` (one contiguous run of uint8 memory, or any when it is one piece) cut into the wire's pieces: views,
    no copy."""
    flat = t.view(-1)
    es = flat.element_size()
    return tuple(flat[o // es:(o + n) // es] for o, n in piece_ranges(flat.numel() * es, piece_bytes, align=es))


class WireWork:
    """The posted pieces of one message; ``wait`` returns once every piece is done."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def done(self) -> bool:
        """Whether every piece has completed (never blocks)."""
        return all(w.is_completed() for w in self.works)


class StagedRecv:
    """A receive into a device buffer that lands in a host buffer when waited on."""

    __slots__ = ("work", "dev", "host")

    def __init__(self, work: Any, dev: torch.Tensor, host: torch.Tensor) -> None:
        self.work, self.dev, self.host = work, dev, host

    def wait(self) -> bool:
        self.work.wait()
        self.host.copy_(self.dev)
        torch.cuda.current_stream().synchronize()
        return True


class RingView(Protocol):
    """What a variant implemented outside ``SecureRing`` reads of the ring it runs on."""

    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def iteration(self) -> int: ...
    @property
    def fault(self) -> RingFault | None: ...
    @property
    def wire(self) -> Wire: ...
