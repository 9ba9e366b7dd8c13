"""The workers' own process group of a fleet (gloo, torchrun's ``env://``): control only, every message sealed
under the fleet key (``core/fleet/auth.py``)."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from gputravel.core.errors import CollectiveError, ConfigError, FleetAuthError

__all__ = ["FleetGroup"]


class FleetGroup:
    """The workers' process group (torchrun's env://, gloo): agreements and reports, no data.

    torchrun's store and gloo's pairing take any client, so every message is sealed under the fleet key
    (:mod:`gputravel.core.fleet.auth`: JSON and an HMAC over the restart, the world, the exchange's index
    and the sender); one that does not open is refused (``FleetAuthError``, counted in ``refused``). No
    pickle crosses the group."""

    def __init__(self, *, key: bytes, timeout_s: float = 900.0, rank: int | None = None,
                 attempt: int | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._key = key
        self._calls = 0
        self.refused = 0  # messages that did not authenticate
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ConfigError(f"a fleet rank runs under torchrun ({name} is not set)")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # the job's attempt as the workers agreed it (core/fleet/node.py: torchrun's own count differs by node)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        self.store_host = os.environ["MASTER_ADDR"]
        self.store_port = int(os.environ["MASTER_PORT"])
        if not dist.is_initialized():
            # torchrun's store outlives an elastic restart: a prefix per restart, so no rank of the new attempt
            # reads an address the old attempt published (measured: connection refused to a dead rank's port)
            timeout = timedelta(seconds=timeout_s)
            base = dist.TCPStore(self.store_host, self.store_port, is_master=False,  # type: ignore[attr-defined]
                                 timeout=timeout)
            store = dist.PrefixStore(f"gputravel/workers/{self.restart}", base)  # type: ignore[attr-defined]
            # the fleet rank: torchrun's, or the rank folder this node holds (core/fleet/node.py)
            dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]) if rank is None else rank,
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), by rank, each authenticated (blocking: call it off the event loop).

        Raises:
            FleetAuthError: a rank's message does not authenticate (injected, altered, replayed, relabelled).
            CollectiveError: the group itself failed.
        """
        import torch

        from gputravel.core.fleet.auth import MAX_MESSAGE_BYTES, open_message, seal_message

        self._calls += 1
        context = f"restart={self.restart} world={self.world} exchange={self._calls}"
        mine = seal_message(self._key, context=context, sender=self.rank, obj=value)
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            self._dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64))
            lengths = [int(t.item()) for t in sizes]
            bad = [r for r, n in enumerate(lengths) if not 0 < n <= MAX_MESSAGE_BYTES]
            if bad:
                self.refused += len(bad)
                raise FleetAuthError(f"rank(s) {bad} announced a message of {[lengths[r] for r in bad]} bytes: "
                                     "not a sealed fleet message; refused")
            width = max(lengths)
            out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            self._dist.all_gather(out, padded)
        except RuntimeError as exc:
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CollectiveError(
                f"the fleet's worker group failed on rank {self.rank}: {said}"
                ": another rank's worker or its node died or was stopped (its node's output names it); every rank's "
                "last sealed checkpoint is the last step all completed: run the same command with --resume on every "
                "node, each with its own --out, to go on") from None
        values = []
        for r, (t, n) in enumerate(zip(out, lengths, strict=True)):
            try:
                values.append(open_message(self._key, t[:n].numpy().tobytes(), context=context, sender=r))
            except FleetAuthError:
                self.refused += 1
                raise
        return values

    async def agree(self, value: Any) -> list[Any]:
        return await asyncio.to_thread(self.gather, value)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

