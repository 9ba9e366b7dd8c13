"""``status.json``: where a run folder says itself how its run stands (``paused``) or ended.

``gputravel runs`` reads a run's status from here first. The console's and ``gputravel run``'s
``RunEnding`` (``console/cli/run_end.py``) writes ``paused`` when the run pauses, removes it when it goes on,
and writes the final status (``completed``, ``partial``, ``failed``, ``cancelled``) when it ends;
``gputravel run --gpus N`` writes the fleet's.
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

__all__ = ["FINAL_STATUSES", "clear_status", "read_status", "write_status"]

#: The statuses a run ends in (``paused`` is written too, but the run is not over).
FINAL_STATUSES = ("completed", "partial", "failed", "cancelled")


def write_status(out_dir: RunFolder | Path, status: str, *, run_id: str | None = None, error: str | None = None,
                 code: str | None = None, t: float | None = None) -> None:
    """Write ``status.json`` (0600, atomically) in the run folder; nothing when the folder is gone."""
    folder = RunFolder.of(out_dir)
    if not folder.path.is_dir():
        return
    record = {"status": status, "final": status in FINAL_STATUSES, "run_id": run_id, "error": error, "code": code,
              "at": time.time() if t is None else t, "pid": os.getpid()}
    with contextlib.suppress(OSError):
        write_atomic(folder.status_file, (json.dumps(record) + "\n").encode(), mode=0o600)


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
