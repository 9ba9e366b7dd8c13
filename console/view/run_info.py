"""A run as a folder (``runs/run-<time>``): what ran, whether it still runs, how it ended.

The folder's names, its pid file and ``status.json`` are ``core/runfolder/`` (:class:`RunFolder`); here a
folder's recordings are folded with the view model into what ``gputravel runs`` reports. The status is read,
never guessed (:func:`read_run`). Cheap to import: no engine, no torch.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputravel.console.view.ending import final_status
from gputravel.console.view.model import RunState
from gputravel.console.view.run_model import model_label
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.events import HolderStateChanged, RunStarted
from gputravel.core.recording import load_recording
from gputravel.core.runfolder import (
    FINAL_STATUSES,
    RESERVE_BYTES,
    RUNS_DIR,
    RunAddress,
    RunFolder,
    driving_process,
    read_marker,
    read_status,
)

__all__ = ["STATUS_CAUSES", "RunInfo", "list_runs", "read_run", "status_word"]

#: error codes a status names beside its word (``failed: disk full``): what the operator fixes before a resume
STATUS_CAUSES = {"disk-full": "disk full", "storage": "storage"}


def status_word(status: str, code: str | None) -> str:
    """A run's status as ``gputravel runs`` and the console show it: the word, and the cause where it is one an
    operator acts on (``failed: disk full``)."""
    return f"{status}: {STATUS_CAUSES[code]}" if code in STATUS_CAUSES else status


@dataclass
class RunInfo:
    """One run folder, as ``gputravel runs`` reports it."""

    name: str
    path: Path
    status: str  # running | paused | completed | partial | failed | cancelled | died | unknown | not started
    pid: int | None = None
    owner: str | None = None
    run_id: str | None = None
    started_at: float | None = None
    error: str | None = None
    code: str | None = None  # the error's code where the run wrote how it ended (``disk-full``, ``device``, ...)
    settings: dict[str, Any] = field(default_factory=dict)
    visits_planned: int = 0
    visits_done: int = 0
    visits_failed: int = 0
    state: RunState | None = None
    fleet: bool = False
    recordings: list[tuple[int | None, Path]] = field(default_factory=list)
    holders: int | None = None  # as the run recorded them (its RunStarted), else its settings
    model: str = "?"  # as the run recorded it (console/view/run_model.py)
    resumed: int = 0  # times it went on with `run --resume` after it had ended
    #: a fleet: its ranks here, merged from other nodes' folders, and on other nodes (core/runfolder/nodes.py)
    nodes: dict[str, Any] | None = None

    @property
    def word(self) -> str:
        """The status with its cause (:func:`status_word`)."""
        return status_word(self.status, self.code)

    @property
    def recording(self) -> Path:
        return self.recordings[0][1] if self.recordings else RunFolder(self.path).recording

    @property
    def ledger(self) -> Path:
        return RunFolder(self.path).ledger

    def to_dict(self, *, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": str(self.path), "status": self.status, "pid": self.pid,
                               "owner": self.owner, "run_id": self.run_id, "started_at": self.started_at,
                               "error": self.error, "code": self.code, "visits_planned": self.visits_planned,
                               "visits_done": self.visits_done, "visits_failed": self.visits_failed,
                               "holders": self.holders, "model": self.model, "resumed": self.resumed,
                               "data_path": self.settings.get("data_path"),
                               "fleet": self.fleet, "nodes": self.nodes,
                               "recording": str(self.recording) if self.recording.exists() else None,
                               "recordings": [str(p) for _, p in self.recordings],
                               "ledger": str(self.ledger) if self.ledger.exists() else None}
        if detail:
            out["settings"] = self.settings
            out["summary"] = self.state.summary() if self.state is not None else None
        return out


def _fleet_report_status(folder: RunFolder) -> tuple[str, str | None] | None:
    """A fleet's status from the merged ``report.json`` rank 0 writes at its end (a fleet the console drove)."""
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(folder.report.read_text())
        if isinstance(report, dict):
            error = report.get("error")
            if isinstance(error, dict):
                code = error.get("code")
                return ("cancelled" if code == "cancelled" else "failed"), str(error.get("reason") or code)
            return ("partial" if report.get("failed_visits") else "completed"), None
    return None


def read_run(path: Path, nodes: tuple[Path, ...] = ()) -> RunInfo:
    """What a run (or fleet) folder says about its run. The status, in this order: ``status.json`` when it
    holds a final status (the run wrote how it ended); the recording's final event; ``running`` (or
    ``paused``) only while the process the run recorded lives; a fleet's merged report; else ``died``
    (something was written, and nothing says how it ended) or ``not started``. ``nodes``: a fleet node's
    folder, the other nodes' folders whose ranks merge with its own."""
    path = Path(path)
    folder = RunFolder(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder")
    address = RunAddress(str(path), path, nodes=tuple(nodes))
    info = RunInfo(name=path.name, path=path, status="not started", fleet=address.fleet,
                   recordings=address.recordings(),
                   nodes=address.fleet_nodes().to_dict() if address.fleet or nodes else None)
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        info.settings = (json.loads(folder.fleet_config.read_text())["settings"] if info.fleet
                         else json.loads(folder.settings.read_text()))
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
    started: set[str] = set()  # the holders the run recorded (every GPU's, in a fleet)
    seen: set[str] = set()  # the holders it reached for, where it ended before it started (an unreachable one)
    for _, _, gpu, event in items:
        state.apply(event, gpu=gpu)
        if event.kind in ("RunCompleted", "RunFailed"):
            final = event
        elif isinstance(event, RunStarted):
            started.update(event.holders)
        elif isinstance(event, HolderStateChanged):
            seen.add(event.holder)
            if gpu is None:
                final = None  # a resumed run goes on in the same recording
    if items:
        info.started_at = info.started_at or items[0][0]
        info.state = state
        info.run_id = state.run_id
        info.visits_planned = state.visits_planned
        info.visits_done = sum(1 for v in state.visits.values() if v.outcome == "done")
        info.visits_failed = sum(1 for row in state.rows.values()  # as the travel panel counts them
                                 if state.visits[row].ended and state.visits[row].outcome != "done")
        info.error = info.error or state.error  # a resumed run's interruption is history, not its error
        info.resumed = state.resumed
    # before its RunStarted: the holders it reached for; an inventory's settings hold the count's default (3), not
    # the inventory's, which may have changed since (unknown, then)
    setting = None if info.settings.get("holders_file") else info.settings.get("holders")
    info.holders = len(started or seen) or (setting if isinstance(setting, int) else None)
    info.model = model_label(info.settings) if info.settings else "?"
    fleet_end = _fleet_report_status(folder) if info.fleet else None
    if written.get("status") in FINAL_STATUSES:
        info.status = str(written["status"])
        info.error = info.error or written.get("error")
        info.code = written.get("code") if isinstance(written.get("code"), str) else None
    elif final is not None and not info.fleet and not (alive and _resuming(marker, final)):
        info.status = final_status(final)  # the run ended, though its process (a console) may live on
        info.code = final.code if final.kind == "RunFailed" else None
    elif alive:
        paused = written.get("status") == "paused" or (not info.fleet and state.status == "paused")
        info.status = "paused" if paused else "running"
    elif fleet_end is not None:
        info.status, error = fleet_end
        info.error = info.error or error
    elif info.recordings or info.ledger.exists() or written:
        info.status, why = _without_final_word(path)
        info.error = info.error or why
    if info.started_at is None:
        with contextlib.suppress(OSError):
            info.started_at = path.stat().st_mtime
    return info


def _without_final_word(path: Path) -> tuple[str, str]:
    """A run whose process is gone and wrote no final word: ``died``; but where its disk is full now, a full
    disk refused its last words too (the run's own ``status.json`` has room kept for it: a run from before
    that, or one whose disk filled before it started), so how it ended is ``unknown``, and the disk is why."""
    gone = "the run's process is gone and it wrote no final event"
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "died", gone
    if free >= RESERVE_BYTES:
        return "died", gone
    return "unknown", (f"{gone}: its disk is full ({free // 1024} KiB free), which refuses a final word too; "
                       f"free space, then `gputravel run --resume --out {path}` continues it")


def _resuming(marker: dict[str, Any], final: Any) -> bool:
    """A ``gputravel run --resume`` that has not recorded its start yet (attesting, connecting): its process
    started after the interrupted part's end (a failure or cancel; a completed run is never resumed), so that
    end is history, not this run's status."""
    started = marker.get("started_at")
    return (final.kind == "RunFailed" and marker.get("owner") == "gputravel run"
            and isinstance(started, int | float) and started > final.t)


def list_runs(root: Path = RUNS_DIR) -> list[RunInfo]:
    """Every run folder under ``root`` (``runs/``), oldest first (``latest`` is a link, listed once), then the runs
    started with ``--out`` outside it, in the order they started (``runs/elsewhere.txt``; each named by its
    absolute path, which every run address takes)."""
    if not root.is_dir():
        return []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    infos = [read_run(p) for p in folders]
    seen = {p.resolve() for p in folders}
    with contextlib.suppress(OSError):
        for line in RunFolder.elsewhere(root).read_text().splitlines():
            path = Path(line)
            if not path.is_absolute() or not RunFolder(path).is_run() or path.resolve() in seen:
                continue  # removed since (or a run refused before its ledger), or indexed twice
            seen.add(path.resolve())
            info = read_run(path)
            info.name = str(path)
            infos.append(info)
    return infos
