"""A rank worker joining its fleet from its own node: the fleet key (agreed by attestation,
:mod:`gputravel.core.fleet.keyagree`) and its fleet rank.

Nodes share no folder, so a node's folder holds the ranks that ran there (``rank-R/``), and torchrun's c10d
rendezvous numbers the nodes in the order they join: a resumed or elastically restarted fleet may give a node
other ranks than its folder holds. The fleet rank is therefore the folder's: each worker says (sealed under the
fleet key) which rank folders its node holds and its local rank; a node's local rank ``l`` takes the ``l``-th
rank its folder holds. A fleet that starts fresh (no node holds a rank folder) keeps torchrun's ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.fleet.auth import open_message, seal_message
from gputravel.core.fleet.keyagree import FleetCvm, agree_fleet_key
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["FleetJoin", "job_attempt", "join_fleet", "my_fleet_rank"]


@dataclass(frozen=True, slots=True)
class FleetJoin:
    key: bytes
    info: dict[str, Any]  # the key agreement's (no key bytes)
    rank: int  # this worker's fleet rank (its rank folder's)
    #: the job's attempt, the same on every node (0: the first; see :func:`job_attempt`)
    attempt: int = 0


def job_attempt(store: Any, job: str, rank: int) -> int:
    """This job's attempt, counted on the store by torchrun rank: how many workers of rank ``rank`` started
    before this one.

    Not ``TORCHELASTIC_RESTART_COUNT``: torchrun counts a restart only on the node whose worker failed; a node
    whose workers it restarts because another node rejoined (a membership change) keeps its count (torch's
    elastic agent: "membership changes do not count as retries"), so the two nodes' counts differ. Every attempt starts one worker of every rank, so the counts agree across
    nodes as long as every worker of an attempt reaches this line (one killed in its first seconds, before it,
    leaves its rank behind: in the next attempt the other ranks wait for its hello in vain and stop at the join
    deadline, named)."""
    return int(store.add(f"gputravel/attempts/{job}/{rank}", 1)) - 1


def my_fleet_rank(folder: RunFolder) -> int:
    """The fleet rank this worker takes (what :func:`join_fleet` agrees with the others): the ``LOCAL_RANK``-th
    rank folder its node holds, or torchrun's ``RANK`` where the node holds none (a fresh fleet).

    Raises:
        ConfigError: the node holds fewer rank folders than it runs workers.
    """
    held = [gpu for gpu, r in folder.ranks() if r.ledger.exists()]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not held:
        return int(os.environ.get("RANK", "0"))
    if local >= len(held):
        raise ConfigError(f"local rank {local} has no rank folder of its own: this node's --out holds ranks {held}; "
                          "a node resumes the ranks it ran")
    return held[local]


def join_fleet(folder: RunFolder, *, timeout_s: float, inject: str | None,
               join_timeout_s: float | None = None) -> FleetJoin:
    """Agree the fleet key and claim this worker's fleet rank (blocking: call it off the event loop).

    Raises:
        FleetJoinError: a worker's first post did not come within ``join_timeout_s`` (its rank and node named).
        AttestationError: a worker's CVM quote was refused (named) or the store did not deliver.
        FleetAuthError: a claim on the store does not authenticate under the fleet key.
        ConfigError: not under torchrun, or the nodes' rank folders do not make one fleet.
    """
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ConfigError(f"a fleet rank runs under torchrun ({name} is not set)")
    job = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # type: ignore[attr-defined]
                         is_master=False, timeout=timedelta(seconds=timeout_s))
    restart = job_attempt(base, job, rank)
    store = dist.PrefixStore(f"gputravel/fleetkey/{job}/{restart}", base)  # type: ignore[attr-defined]
    fault = inject if inject in ("cvm-debug", "cvm-report-data") else None
    context = f"job={job} restart={restart}"
    agreed = agree_fleet_key(store, rank=rank, world=world, context=context, cvm=FleetCvm.sim(folder.cvm),
                             timeout_s=timeout_s, fault=fault,
                             join_timeout_s=min(timeout_s, join_timeout_s or timeout_s),
                             ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    held = [gpu for gpu, r in folder.ranks() if r.ledger.exists()]
    claim = {"held": held, "local": int(os.environ.get("LOCAL_RANK", "0")), "node": os.environ.get("GROUP_RANK")}
    store.set(f"claim/{rank}", seal_message(agreed.key, context=f"claim {context}", sender=rank, obj=claim).hex())
    claims = []
    for r in range(world):
        store.wait([f"claim/{r}"], timedelta(seconds=timeout_s))
        claims.append(open_message(agreed.key, bytes.fromhex(store.get(f"claim/{r}").decode()),
                                   context=f"claim {context}", sender=r))
    if not any(c["held"] for c in claims):
        return FleetJoin(agreed.key, {**agreed.info, "attempt": restart}, rank, restart)
    ranks = []
    for r, c in enumerate(claims):
        held_r, local = [int(g) for g in c["held"]], int(c["local"])
        if local >= len(held_r):
            raise ConfigError(f"torchrun rank {r} (node {c['node']}, local rank {local}) has no rank folder of its "
                              f"own: its node's --out holds ranks {held_r}; a node resumes the ranks it ran")
        ranks.append(held_r[local])
    if sorted(ranks) != list(range(world)):
        raise ConfigError(f"the nodes' rank folders {sorted(ranks)} are not ranks 0..{world - 1} once each")
    return FleetJoin(agreed.key, {**agreed.info, "fleet_rank_of": ranks, "attempt": restart}, ranks[rank], restart)
