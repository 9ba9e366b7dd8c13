"""A fleet's processes end with its launcher, however the launcher ends.

``gputravel run --gpus N`` (the launcher) starts torchrun, torchrun starts one worker per rank, each worker its
device service and its holders' agents (or the embedded SSH server that starts them). Stopped the usual way
(Ctrl-C), each stops the next: the launcher SIGTERMs torchrun (``tee.run_teed``), whose
agent SIGTERMs each worker's process group (torch 2.13: its handler of SIGTERM, SIGINT, SIGHUP and SIGQUIT,
installed when it starts the workers; those still alive 30 s later are killed). Killed outright (kill -9, the
OOM killer, a job scheduler) a process runs nothing, and torchrun puts each worker in a session of its own, so
no group kill reaches them either. Every link of the chain is therefore tied to its parent by the kernel
(``PR_SET_PDEATHSIG``, SIGKILL): torchrun to the launcher (``run_teed``), each worker to torchrun (here, from
the worker's own first lines: torchrun starts it), the device service and agents to their worker
(``core.procs.die_with_parent``). Holders reached over SSH end when their SSH session closes with the worker.
"""

from __future__ import annotations

import os

from gputravel.core.procs import end_with_parent

__all__ = ["LAUNCHER_PID_ENV", "end_with_launcher"]

#: the launcher's pid, in torchrun's environment and so in each worker's
LAUNCHER_PID_ENV = "GPUTRAVEL_LAUNCHER_PID"


def end_with_launcher() -> str | None:
    """A worker's first lines (before its imports, which take seconds): it dies (SIGKILL) with torchrun, its parent,
    which dies with the launcher. torchrun's parent must be the launcher named in ``LAUNCHER_PID_ENV``: a worker
    whose torchrun (or launcher) died before this call ends itself here. Returns None once armed, else why
    nothing could be armed on this platform (a no-op: ``core.procs.NO_PARENT_DEATH_SIGNAL``)."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    return end_with_parent(grandparent=int(raw) if raw.isdigit() else None)
