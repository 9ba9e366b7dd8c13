"""``status.json``: where a run folder says itself how its run stands (``paused``) or ended.

``gputravel runs`` reads a run's status from here first. The console's and ``gputravel run``'s
``RunEnding`` (``console/cli/run_end.py``) writes ``paused`` when the run pauses, removes it when it goes on,
and writes the final status (``completed``, ``partial``, ``failed``, ``cancelled``) when it ends;
``gputravel run --gpus N`` writes the fleet's.

A run stopped by a full disk needs the disk to say so: the ledger's last row, the recording's ``RunFailed`` and
``status.json`` were all refused, and ``gputravel runs`` said ``died`` (operator walk, session 15). So a run keeps
room for its last word: :func:`reserve_status` writes :data:`RESERVE_BYTES` into the folder as it starts, and a
``status.json`` the disk refuses is written again after that room is given back. A final status gives it back
too (a ``--resume`` reserves it again).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from gputravel.core.files import write_atomic
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["FINAL_STATUSES", "RESERVE_BYTES", "clear_status", "read_status", "reserve_status", "write_status"]

#: The statuses a run ends in (``paused`` is written too, but the run is not over).
FINAL_STATUSES = ("completed", "partial", "failed", "cancelled")

#: The room a run keeps for its last ``status.json``: the record (under 1 KiB), its temporary file's block and
#: the folder's entry, many times over on any block size.
RESERVE_BYTES = 64 * 1024


def reserve_status(out_dir: RunFolder | Path) -> bool:
    """Keep :data:`RESERVE_BYTES` on the run folder's disk for its last ``status.json`` (written, so they are
    allocated, not a sparse file). False when the disk has not even that (the run will fail soon, as before)."""
    folder = RunFolder.of(out_dir)
    try:
        write_atomic(folder.status_reserve, bytes(RESERVE_BYTES), mode=0o600)
    except OSError:
        return False
    return True


def write_status(out_dir: RunFolder | Path, status: str, *, run_id: str | None = None, error: str | None = None,
                 code: str | None = None, t: float | None = None) -> None:
    """Write ``status.json`` (0600, atomically) in the run folder; nothing when the folder is gone."""
    folder = RunFolder.of(out_dir)
    if not folder.path.is_dir():
        return
    record = {"status": status, "final": status in FINAL_STATUSES, "run_id": run_id, "error": error, "code": code,
              "at": time.time() if t is None else t, "pid": os.getpid()}
    data = (json.dumps(record) + "\n").encode()
    try:
        write_atomic(folder.status_file, data, mode=0o600)
    except OSError:  # a full disk: the room kept for this, given back, then once more
        if not _give_back(folder):
            return
        with contextlib.suppress(OSError):
            write_atomic(folder.status_file, data, mode=0o600)
        return
    if status in FINAL_STATUSES:
        _give_back(folder)


def _give_back(folder: RunFolder) -> bool:
    try:
        folder.status_reserve.unlink()
    except OSError:
        return False
    return True


def read_status(out_dir: RunFolder | Path) -> dict[str, Any]:
    """``status.json`` as a dict (empty: none, or unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(RunFolder.of(out_dir).status_file.read_text())
        if isinstance(record, dict) and isinstance(record.get("status"), str):
            return record
    return {}


def clear_status(out_dir: RunFolder | Path) -> None:
    """A run goes (again, after a pause or on ``--resume``): no status is written until it pauses or ends."""
    with contextlib.suppress(OSError):
        RunFolder.of(out_dir).status_file.unlink()
