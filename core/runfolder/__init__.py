"""The run folder: what a run writes, where, and how it is read back. Read first:

* ``folder.py``: :class:`RunFolder`, the type that spells every name in a run folder (settings, ledger,
  recording, status, pid file, report, ``fleet.json``, ``rank-N/``, checkpoints, keys, platform, receipts);
* ``address.py``: :func:`resolve_run`, one address for every command that takes a run;
* ``claim.py``: :class:`RunClaim`, creating a run's folder and giving it back if the run never started;
* ``pidfile.py``: the process that drives a run (``mark_running``, ``signal_run``);
* ``status.py``: the folder's own word on its status (``write_status``, ``read_status``);
* ``resume.py``: what a ``--resume`` builds on, checked before anything starts (``verify_run_folder``).

Torch-free and Textual-free; how a run's *events* fold into a status is the console's
(``console/view/run_info.py``).
"""

from __future__ import annotations

from gputravel.core.runfolder.address import (
    RUN_ADDRESS_HELP,
    RunAddress,
    find_run,
    is_run_folder,
    replay_target,
    resolve_run,
)
from gputravel.core.runfolder.claim import RunClaim
from gputravel.core.runfolder.folder import RUNS_DIR, RunFolder
from gputravel.core.runfolder.pidfile import (
    clear_running,
    driving_process,
    mark_running,
    pid_alive,
    read_marker,
    running_marker,
    signal_run,
)
from gputravel.core.runfolder.resume import (
    UNSEALED_SETTINGS,
    RunFolderCheck,
    read_settings,
    saved_settings,
    sealed_settings_digest,
    settings_digest,
    verify_run_folder,
)
from gputravel.core.runfolder.status import (
    FINAL_STATUSES,
    RESERVE_BYTES,
    clear_status,
    read_status,
    reserve_status,
    write_status,
)

__all__ = ["FINAL_STATUSES", "RESERVE_BYTES", "RUNS_DIR", "RUN_ADDRESS_HELP", "UNSEALED_SETTINGS",
           "RunAddress", "RunClaim", "RunFolder", "RunFolderCheck", "clear_running", "clear_status",
           "driving_process", "find_run", "is_run_folder", "mark_running", "pid_alive", "read_marker",
           "read_settings", "read_status", "replay_target", "reserve_status", "resolve_run",
           "running_marker", "saved_settings", "sealed_settings_digest", "settings_digest", "signal_run",
           "verify_run_folder", "write_status"]
