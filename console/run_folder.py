"""A run as a folder (``runs/run-<time>``): what ran, whether it still runs, how it ended.

A run folder holds ``settings.json`` (written by the engine), ``ledger.db`` and ``recording.db``; while a run
goes, ``orchestrator.pid`` names the process that drives it (``gputravel run`` or ``gputravel-console``), so
``gputravel runs stop`` can signal it. The status is read, never guessed: the pid file and a live process
say ``running``; otherwise the recording's final event (``RunCompleted``/``RunFailed``) says how it ended; a
run with neither died without a word (``died``). Cheap to import: no engine, no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputravel.console.run_end import final_status
from gputravel.console.view_model import RunState
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.files import keep_private, make_tree_private, write_atomic
from gputravel.core.procs import ProcessIdentity, identity_matches, process_identity
from gputravel.core.recording import load_recording

__all__ = ["PID_FILE", "RUNS_DIR", "RunInfo", "clear_running", "driving_process", "find_run", "list_runs",
           "mark_running", "pid_alive", "read_marker", "read_run", "running_marker", "signal_run"]

RUNS_DIR = Path("runs")
PID_FILE = "orchestrator.pid"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def mark_running(out_dir: Path, *, owner: str) -> Path:
    """Write ``orchestrator.pid`` (this process drives the run in ``out_dir``): its pid, start time and command
    line as ``/proc`` says them, so ``runs stop`` signals this process and never one that reused the pid."""
    path = Path(out_dir) / PID_FILE
    keep_private()  # a console's --out folder is not claimed through RunFolder: private from here on
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    make_tree_private(path.parent)
    me = process_identity(os.getpid())
    record = {**(me.to_dict() if me is not None else {"pid": os.getpid()}), "owner": owner, "started_at": time.time()}
    write_atomic(path, (json.dumps(record) + "\n").encode(), mode=0o600)
    return path


def read_marker(out_dir: Path) -> dict[str, Any]:
    """``orchestrator.pid`` as a dict (empty: none, or unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        marker = json.loads((Path(out_dir) / PID_FILE).read_text())
        if isinstance(marker, dict):
            return marker
    return {}


def driving_process(out_dir: Path) -> ProcessIdentity | None:
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
def running_marker(out_dir: Path, *, owner: str) -> Iterator[Path]:
    """``orchestrator.pid`` in the run folder for as long as the run goes (removed however it ends)."""
    path = mark_running(out_dir, owner=owner)
    try:
        yield path
    finally:
        clear_running(path)


def signal_run(out_dir: Path, sig: int, *, name: str | None = None) -> int:
    """Send ``sig`` to the process driving the run in ``out_dir`` and return its pid, only if it is the
    process ``orchestrator.pid`` recorded (pid, start time, command line). The process is pinned first
    (a pidfd), then checked, then signalled through the pidfd: a pid reused in between is never hit.

    Raises:
        ConfigError: no live process drives the run, or the pid now belongs to another process; nothing
            was signalled.
    """
    out_dir = Path(out_dir)
    name = name or out_dir.name
    marker = read_marker(out_dir)
    pid = marker.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ConfigError(f"run {name} has no process to signal (no {PID_FILE}); nothing signalled")
    fd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    try:
        if identity_matches(marker) is None:
            if process_identity(pid) is None:
                raise ConfigError(f"run {name}: its process (pid {pid}) is gone; nothing signalled")
            raise ConfigError(f"run {name}: {PID_FILE} names pid {pid}, but that pid is now another process "
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


@dataclass
class RunInfo:
    """One run folder, as ``gputravel runs`` reports it."""

    name: str
    path: Path
    status: str  # running | completed | partial | failed | cancelled | died | not started
    pid: int | None = None
    owner: str | None = None
    run_id: str | None = None
    started_at: float | None = None
    error: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    visits_planned: int = 0
    visits_done: int = 0
    visits_failed: int = 0
    state: RunState | None = None

    @property
    def recording(self) -> Path:
        return self.path / "recording.db"

    @property
    def ledger(self) -> Path:
        return self.path / "ledger.db"

    def to_dict(self, *, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": str(self.path), "status": self.status, "pid": self.pid,
                               "owner": self.owner, "run_id": self.run_id, "started_at": self.started_at,
                               "error": self.error, "visits_planned": self.visits_planned,
                               "visits_done": self.visits_done, "visits_failed": self.visits_failed,
                               "holders": self.settings.get("holders"), "data_path": self.settings.get("data_path"),
                               "recording": str(self.recording) if self.recording.exists() else None,
                               "ledger": str(self.ledger) if self.ledger.exists() else None}
        if detail:
            out["settings"] = self.settings
            out["summary"] = self.state.summary() if self.state is not None else None
        return out


def read_run(path: Path) -> RunInfo:
    """What a run folder says about its run."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder")
    info = RunInfo(name=path.name, path=path, status="not started")
    with contextlib.suppress(OSError, ValueError):
        info.settings = json.loads((path / "settings.json").read_text())
    marker = read_marker(path)
    alive = driving_process(path) is not None
    if alive:
        info.pid, info.owner = int(marker["pid"]), marker.get("owner")
        info.started_at = marker.get("started_at")
    state = RunState()
    final = None
    if info.recording.exists():
        try:
            recording = load_recording(info.recording)
        except GpuTravelError as exc:
            info.error = str(exc)
        else:
            info.started_at = info.started_at or recording.meta.get("started_at")
            for event in recording.events():
                state.apply(event)
                if event.kind in ("RunCompleted", "RunFailed"):
                    final = event
            info.started_at = info.started_at or (recording.items[0].t if recording.items else None)
        info.state = state
        info.run_id = state.run_id
        info.visits_planned = state.visits_planned
        info.visits_done = sum(1 for v in state.visits.values() if v.outcome == "done")
        info.visits_failed = sum(1 for row in state.rows.values() if state.visits[row].outcome == "failed")
        info.error = info.error or state.error
    if alive:
        info.status = "running"
    elif final is not None:
        info.status = final_status(final)
    elif info.recording.exists() or info.ledger.exists():
        info.status = "died"  # no process and no final event: it ended without saying how
        info.error = info.error or "the run's process is gone and it wrote no final event"
    if info.started_at is None:
        with contextlib.suppress(OSError):
            info.started_at = path.stat().st_mtime
    return info


def list_runs(root: Path = RUNS_DIR) -> list[RunInfo]:
    """Every run folder under ``root`` (``runs/``), oldest first (``latest`` is a link, listed once)."""
    if not root.is_dir():
        return []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    return [read_run(p) for p in folders]


def find_run(name: str, root: Path = RUNS_DIR) -> Path:
    """``RUN`` as the CLI takes it: a folder path, a name under ``runs/`` (``run-20250101-120000``), a unique
    prefix or suffix of one, or ``latest``."""
    direct = Path(name)
    if direct.is_dir() and ((direct / "settings.json").exists() or (direct / "recording.db").exists()):
        return direct
    if (root / name).is_dir():
        return (root / name).resolve() if name == "latest" else root / name
    if root.is_dir():
        matches = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                         and (p.name.startswith(name) or p.name.endswith(name) or p.name == f"run-{name}"))
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ConfigError(f"run {name!r} is ambiguous: {', '.join(p.name for p in matches)}")
    raise ConfigError(f"no run {name!r} under {root}/ (gputravel runs ls lists them)")
