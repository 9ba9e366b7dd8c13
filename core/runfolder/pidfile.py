"""``orchestrator.pid``: the process that drives a run, while it runs (``gputravel run`` or
``gputravel-console``: pid, start time, command line), so ``gputravel runs stop`` signals that process and
never one that reused its pid."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.files import close_folder, keep_private, write_atomic
from gputravel.core.procs import ProcessIdentity, identity_matches, process_identity
from gputravel.core.runfolder.folder import RunFolder
from gputravel.core.runfolder.status import clear_status

__all__ = ["clear_running", "driving_process", "mark_running", "pid_alive", "read_marker", "running_marker",
           "signal_run"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def mark_running(out_dir: RunFolder | Path, *, owner: str) -> Path:
    """Write ``orchestrator.pid`` (this process drives the run in ``out_dir``): its pid, start time and command
    line as ``/proc`` says them, so ``runs stop`` signals this process and never one that reused the pid."""
    folder = RunFolder.of(out_dir)
    path = folder.pid_file
    keep_private()  # a console's --out folder is not claimed through RunClaim: private from here on
    folder.path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.is_run():  # the run's own folder: closed to others (its files keep their modes,
        close_folder(folder.path)  # so a key others could read is still refused, never quietly fixed)
    me = process_identity(os.getpid())
    record = {**(me.to_dict() if me is not None else {"pid": os.getpid()}), "owner": owner, "started_at": time.time()}
    write_atomic(path, (json.dumps(record) + "\n").encode(), mode=0o600)
    clear_status(folder)  # the run goes (again, on --resume): no status until it pauses or ends
    return path


def read_marker(out_dir: RunFolder | Path) -> dict[str, Any]:
    """``orchestrator.pid`` as a dict (empty: none, or unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        marker = json.loads(RunFolder.of(out_dir).pid_file.read_text())
        if isinstance(marker, dict):
            return marker
    return {}


def driving_process(out_dir: RunFolder | Path) -> ProcessIdentity | None:
    """The live process that ``orchestrator.pid`` names, if it is still that process (same pid, start time
    and command line); None when it is gone, the pid now belongs to another process, or the file does not
    say who wrote it."""
    return identity_matches(read_marker(out_dir))


def clear_running(path: Path) -> None:
    """Remove a pid file this process wrote (idempotent)."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


@contextlib.contextmanager
def running_marker(out_dir: RunFolder | Path, *, owner: str) -> Iterator[Path]:
    """``orchestrator.pid`` in the run folder for as long as the run goes (removed however it ends)."""
    path = mark_running(out_dir, owner=owner)
    try:
        yield path
    finally:
        clear_running(path)


def signal_run(out_dir: RunFolder | Path, sig: int, *, name: str | None = None) -> int:
    """Send ``sig`` to the process driving the run in ``out_dir`` and return its pid, only if it is the
    process ``orchestrator.pid`` recorded (pid, start time, command line). The process is pinned first
    (a pidfd), then checked, then signalled through the pidfd: a pid reused in between is never hit.

    Raises:
        ConfigError: no live process drives the run, or the pid now belongs to another process; nothing
            was signalled.
    """
    folder = RunFolder.of(out_dir)
    name = name or folder.name
    pid_name = folder.pid_file.name
    marker = read_marker(folder)
    pid = marker.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ConfigError(f"run {name} has no process to signal (no {pid_name}); nothing signalled")
    fd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    try:
        if identity_matches(marker) is None:
            if process_identity(pid) is None:
                raise ConfigError(f"run {name}: its process (pid {pid}) is gone; nothing signalled")
            raise ConfigError(f"run {name}: {pid_name} names pid {pid}, but that pid is now another process "
                              f"(its start time or command line differ from the run's record: the pid was "
                              f"reused); nothing signalled")
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:  # pragma: no cover - a kernel without pidfds
            os.kill(pid, sig)
    finally:
        if fd is not None:
            os.close(fd)
    return pid
