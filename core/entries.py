"""The programs a run starts, as the caller names them: core starts them, never names them.

The console (the composition root's caller) fills in :class:`Entries`: the holder agent's module for local
holders, the module torchrun starts once per GPU of a fleet. Standard library only: the CLI imports it at
start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.core.errors import ConfigError

__all__ = ["Entries"]


@dataclass(frozen=True, kw_only=True)
class Entries:
    """The programs a run starts, named by the caller (the console is the composition root's caller).

    ``holder_agent``: the local holder agent's command line after the Python interpreter (``("-m", module)``);
    ``gpu_rank``: the module torchrun starts once per GPU of a fleet (``python -m MODULE --config FILE``).
    ``process_roles``: a command-line marker -> role, to tell the processes of those programs apart.
    """

    holder_agent: tuple[str, ...] = ()
    gpu_rank: str | None = None
    process_roles: tuple[tuple[str, str], ...] = ()

    def agent(self) -> tuple[str, ...]:
        if not self.holder_agent:
            raise ConfigError("no holder agent entry: local holders need the caller's Entries.holder_agent")
        return self.holder_agent

    def rank(self) -> str:
        if not self.gpu_rank:
            raise ConfigError("no GPU rank entry: a fleet needs the caller's Entries.gpu_rank")
        return self.gpu_rank
