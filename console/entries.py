"""The programs a run starts, named here, by the console (core's caller), and passed into core.

Core starts the holder agent (local holders) and torchrun's rank module (a fleet of GPUs) but never names
them: every run is composed by ``gputravel.core.compose`` with these :data:`ENTRIES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gputravel.core.entries import Entries

if TYPE_CHECKING:
    from gputravel.core.config import RunSettings
    from gputravel.core.fleet.rank import FleetOptions

__all__ = ["ENTRIES", "GPU_RANK", "HOLDER_AGENT", "launch_gpus"]

#: ``python -m gputravel.agents.holder``: the holder agent on stdin/stdout
HOLDER_AGENT = "gputravel.agents.holder"
#: one torchrun rank of ``gputravel run --gpus N``
GPU_RANK = "gputravel.console.cli.fleet_rank"

ENTRIES = Entries(holder_agent=("-m", HOLDER_AGENT), gpu_rank=GPU_RANK,
                  process_roles=((HOLDER_AGENT, "agents"), ("gputravel.agents.sshserver", "ssh_server")))


def launch_gpus(settings: RunSettings, fleet: FleetOptions, **kw: Any) -> dict[str, Any]:
    """A fleet of GPUs under torchrun, each rank running :data:`GPU_RANK` (``core.fleet.run.launch_fleet``)."""
    from gputravel.core.fleet.run import launch_fleet  # torch: only when a fleet starts

    return launch_fleet(settings, fleet, entry=ENTRIES.rank(), **kw)
