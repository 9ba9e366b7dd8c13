"""The agreement that ends every secure all-reduce: each rank learns whether any rank rejected a hop.

Its outcome is one number, the highest ``rank + 1`` of a rank that rejected a hop (0: none), the same on every
rank; on a nonzero outcome no rank keeps its result (``ring.SecureRing._agree``). Two ways to reach it:

- ``all_reduce_status``: a 4-byte ``dist.all_reduce(MAX)``, any world size, any backend;
- ``exchange_status`` (world 2 on gloo): one 4-byte message each way, both posted at once. gloo's all-reduce runs
  its own algorithm (its rounds and buffer notices) for the 4 bytes; the exchange is one round. Measured at 1 MiB,
  world 2 (docs/collectives.md, session 13): calls interleaved in one run, the fastest quarter 2.45-2.71 ms
  against 2.87-3.02 with the all-reduce.

Neither is sealed, as before: the status only ever makes ranks drop a result. A host that forges a 0 cannot make a
rank keep a sum it rejected (that rank raises its own ``TagError``); it can hide one rank's rejection from the
other, as it could with the all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gputravel.core.errors import CollectiveError

__all__ = ["STATUS_TAG", "all_reduce_status", "exchange_status"]

#: the status message's gloo tag: above every hop's (``Wire.exchange`` tags a hop ``tag * MAX_PIECES + piece``,
#: with ``tag`` at most steps times chunks)
STATUS_TAG = (1 << 30) + 7


def all_reduce_status(mine: int, *, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The agreement as a 4-byte all-reduce (MAX) over ``group``: any world size, gloo or NCCL."""
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def exchange_status(mine: int, *, group: dist.ProcessGroup | None, peer: int) -> int:
    """The agreement at world 2 on gloo: send ``mine`` to ``peer`` (its global rank) and receive the peer's, in
    one round; returns the larger."""
    out = torch.tensor([mine], dtype=torch.int32)
    theirs = torch.zeros(1, dtype=torch.int32)
    recv = dist.irecv(theirs, peer, group=group, tag=STATUS_TAG)
    send = dist.isend(out, peer, group=group, tag=STATUS_TAG)
    if recv is None or send is None:  # torch's answer for a rank outside the group
        raise CollectiveError("the agreement's status exchange: this rank is not in the ring's group")
    recv.wait()
    send.wait()
    return max(mine, int(theirs[0]))
