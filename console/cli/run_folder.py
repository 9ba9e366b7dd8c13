"""A run as a folder (``runs/run-<time>``): what ran, whether it still runs, how it ended.

A run folder holds ``settings.json`` (written by the engine), ``ledger.db`` and ``recording.db`` (a fleet folder
``fleet.json``, its ledger and ``rank-N/`` folders); while a run goes, ``orchestrator.pid`` names the process
that drives it (``gputravel run`` or ``gputravel-console``: pid, start time, command line), so ``gputravel runs
stop`` can signal it; when the run pauses or ends it writes ``status.json`` (``console/cli/run_end.py``). The status
is read, never guessed (:func:`read_run`). Cheap to import: no engine, no torch.
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

from gputravel.console.cli.run_address import RUNS_DIR, RunAddress, is_run_folder, resolve_run
from gputravel.console.cli.run_end import FINAL_STATUSES, clear_status, final_status, read_status
from gputravel.console.tui.view_model import RunState
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.files import close_folder, keep_private, write_atomic
from gputravel.core.procs import ProcessIdentity, identity_matches, process_identity
from gputravel.core.recording import load_recording

__all__ = ["PID_FILE", "RUNS_DIR", "RunInfo", "clear_running", "driving_process", "find_run", "list_runs",
           "mark_running", "pid_alive", "read_marker", "read_run", "running_marker", "signal_run"]

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
    if is_run_folder(path.parent):  # the run's own folder: closed to others (its files keep their modes,
        close_folder(path.parent)   # so a key others could read is still refused, never quietly fixed)
    me = process_identity(os.getpid())
    record = {**(me.to_dict() if me is not None else {"pid": os.getpid()}), "owner": owner, "started_at": time.time()}
    write_atomic(path, (json.dumps(record) + "\n").encode(), mode=0o600)
    clear_status(path.parent)  # the run goes (again, on --resume): no status until it pauses or ends
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
    status: str  # running | paused | completed | partial | failed | cancelled | died | not started
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
    fleet: bool = False
    recordings: list[tuple[int | None, Path]] = field(default_factory=list)

    @property
    def recording(self) -> Path:
        return self.recordings[0][1] if self.recordings else self.path / "recording.db"

    @property
    def ledger(self) -> Path:
        return self.path / "ledger.db"

    def to_dict(self, *, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": str(self.path), "status": self.status, "pid": self.pid,
                               "owner": self.owner, "run_id": self.run_id, "started_at": self.started_at,
                               "error": self.error, "visits_planned": self.visits_planned,
                               "visits_done": self.visits_done, "visits_failed": self.visits_failed,
                               "holders": self.settings.get("holders"), "data_path": self.settings.get("data_path"),
                               "fleet": self.fleet,
                               "recording": str(self.recording) if self.recording.exists() else None,
                               "recordings": [str(p) for _, p in self.recordings],
                               "ledger": str(self.ledger) if self.ledger.exists() else None}
        if detail:
            out["settings"] = self.settings
            out["summary"] = self.state.summary() if self.state is not None else None
        return out


def _fleet_report_status(path: Path) -> tuple[str, str | None] | None:
    """A fleet's status from the merged ``report.json`` rank 0 writes at its end (a fleet the console drove)."""
    with contextlib.suppress(OSError, ValueError):
        report = json.loads((path / "report.json").read_text())
        if isinstance(report, dict):
            error = report.get("error")
            if isinstance(error, dict):
                code = error.get("code")
                return ("cancelled" if code == "cancelled" else "failed"), str(error.get("reason") or code)
            return ("partial" if report.get("failed_visits") else "completed"), None
    return None


def read_run(path: Path) -> RunInfo:
    """What a run (or fleet) folder says about its run. The status, in this order: ``status.json`` when it
    holds a final status (the run wrote how it ended); the recording's final event; ``running`` (or
    ``paused``) only while the process the run recorded lives; a fleet's merged report; else ``died``
    (something was written, and nothing says how it ended) or ``not started``."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder")
    address = RunAddress(str(path), path)
    info = RunInfo(name=path.name, path=path, status="not started", fleet=address.fleet,
                   recordings=address.recordings())
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        info.settings = (json.loads((path / "fleet.json").read_text())["settings"] if info.fleet
                         else json.loads((path / "settings.json").read_text()))
    marker = read_marker(path)
    alive = driving_process(path) is not None
    if alive:
        info.pid, info.owner = int(marker["pid"]), marker.get("owner")
        info.started_at = marker.get("started_at")
    written = read_status(path)
    state = RunState()
    final = None
    items: list[tuple[float, int, int | None, Any]] = []
    for gpu, rec_path in info.recordings:
        try:
            recording = load_recording(rec_path)
        except GpuTravelError as exc:
            info.error = str(exc)
            continue
        info.started_at = info.started_at or recording.meta.get("started_at")
        items.extend((e.t, n, gpu, e) for n, e in enumerate(recording.events()))
    items.sort(key=lambda x: (x[0], -1 if x[2] is None else x[2], x[1]))
    for _, _, gpu, event in items:
        state.apply(event, gpu=gpu)
        if event.kind in ("RunCompleted", "RunFailed"):
            final = event
        elif event.kind == "RunStarted" and gpu is None:
            final = None  # a resumed run goes on in the same recording
    if items:
        info.started_at = info.started_at or items[0][0]
        info.state = state
        info.run_id = state.run_id
        info.visits_planned = state.visits_planned
        info.visits_done = sum(1 for v in state.visits.values() if v.outcome == "done")
        info.visits_failed = sum(1 for row in state.rows.values() if state.visits[row].outcome == "failed")
        info.error = info.error or state.error
    fleet_end = _fleet_report_status(path) if info.fleet else None
    if written.get("status") in FINAL_STATUSES:
        info.status = str(written["status"])
        info.error = info.error or written.get("error")
    elif final is not None and not info.fleet:  # the run ended, though its process (a console) may live on
        info.status = final_status(final)
    elif alive:
        paused = written.get("status") == "paused" or (not info.fleet and state.status == "paused")
        info.status = "paused" if paused else "running"
    elif fleet_end is not None:
        info.status, error = fleet_end
        info.error = info.error or error
    elif info.recordings or info.ledger.exists() or written:
        info.status = "died"  # no process and no final word: it ended without saying how
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
    """The run folder ``name`` addresses (:func:`~gputravel.console.cli.run_address.resolve_run`: a folder, a fleet
    folder, a recording in a run folder, a name or unambiguous prefix under ``runs/``, or ``latest``)."""
    address = resolve_run(name, root)
    if address.folder is None:
        raise ConfigError(f"{name}: a file outside any run folder (gputravel replay reads a lone recording)")
    return address.folder
