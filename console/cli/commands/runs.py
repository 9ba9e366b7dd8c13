"""``gputravel runs``: runs as things to list, inspect, follow, stop and continue (``ls``, ``show``, ``log``,
``stop``, ``resume``, ``step``).

A run is a folder under ``runs/`` (see :mod:`gputravel.core.runfolder`). Every command takes ``--json``;
with it, an error is the CLI's one JSON error object on stdout too (``console/cli/errors.py``), and the exit
code is the error's documented one.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.console.cli.output import out_console
from gputravel.console.view.run_info import RunInfo, list_runs, read_run
from gputravel.core.errors import ConfigError
from gputravel.core.runfolder import (
    FINAL_STATUSES,
    RUN_ADDRESS_HELP,
    RUNS_DIR,
    RunAddress,
    driving_process,
    find_run,
    read_marker,
    read_status,
    signal_run,
)

runs_app = typer.Typer(name="runs", help="Runs under runs/: list, show, follow the log, stop, resume or step a "
                       "paused one.", no_args_is_help=True)

RunsDir = Annotated[Path, typer.Option("--runs-dir", help="Folder that holds the run folders.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON (errors too).")]
RunArg = Annotated[str, typer.Argument(help=RUN_ADDRESS_HELP, metavar="RUN", show_default=False)]
STATUS_STYLE = {"running": "bold cyan", "paused": "yellow", "completed": "green", "partial": "yellow", "failed": "bold red",
                "cancelled": "yellow", "died": "bold red", "unknown": "bold red", "not started": "dim"}


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")


def _json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _when(t: float | None, *, short: bool = False) -> str:
    """A run's start: ``2026-11-29 14:04:35``, or ``11-29 14:04`` where the screen is narrow."""
    return datetime.fromtimestamp(t).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S") if t else "-"


#: below this many columns ``runs ls`` gives its start without year and seconds: at 80 columns a row of a run
#: started with ``--out /tmp/...`` ran to 87 and the terminal broke it, its pid alone on the next line (walk 16)
NARROW_LS = 100


def _status(info: RunInfo) -> str:
    style = STATUS_STYLE.get(info.status, "")
    resumed = f" [dim](resumed{f' {info.resumed}x' if info.resumed > 1 else ''})[/]" if info.resumed else ""
    return (f"[{style}]{escape(info.word)}[/]" if style else escape(info.word)) + resumed


@runs_app.command("ls")
def ls_cmd(runs_dir: RunsDir = RUNS_DIR, as_json: AsJson = False) -> None:
    """List the runs: status (running, paused, completed, partial, failed, cancelled, died, unknown), visits, start."""
    runs = list_runs(runs_dir)
    if as_json:
        _json({"runs_dir": str(runs_dir), "runs": [r.to_dict() for r in runs]})
        return
    console = out_console()
    if not runs:
        console.print(f"no runs under {escape(str(runs_dir))}/ (gputravel run starts one)", highlight=False)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("run", "status", "visits", "holders", "model", "started", "pid"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("visits", "holders", "pid") else "left")
    for r in runs:
        visits = f"{r.visits_done}/{r.visits_planned or '?'}" + (f" ({r.visits_failed}✗)" if r.visits_failed else "")
        table.add_row(escape(r.name), _status(r), visits, str(r.holders or "?"), escape(r.model),
                      _when(r.started_at, short=console.width < NARROW_LS), str(r.pid or "-"))
    console.print(table)


NodeFolders = Annotated[list[Path] | None, typer.Option(
    "--node-folder", metavar="DIR", help="A fleet over several nodes: another node's fleet folder (or a copy), "
    "whose ranks merge with this node's (repeatable).")]


def _uncommitted(info: RunInfo) -> set[int]:
    """Visits the recording shows done whose progress the ledger never committed: the run ended (a kill, a full
    disk) before their checkpoint was durable, so ``gputravel run --resume`` redoes them (the ledger is the truth;
    the recording's ``VisitCompleted`` comes as the visit ends, its commit once its checkpoint is written)."""
    if info.fleet or info.state is None or info.status not in ("died", "unknown", "failed", "cancelled"):
        return set()
    from gputravel.core.errors import GpuTravelError
    from gputravel.core.ledger import read_rows

    try:
        committed = {row.detail.get("visit") for row in read_rows(info.ledger) if row.kind == "visit-completed"}
    except GpuTravelError:  # no ledger, or not one: nothing to say about commits
        return set()
    return {v.visit for v in info.state.visits.values() if v.outcome == "done" and v.visit not in committed}


@runs_app.command("show")
def show_cmd(run: RunArg, runs_dir: RunsDir = RUNS_DIR, as_json: AsJson = False,
             node_folders: NodeFolders = None) -> None:
    """One run: status, settings, visits and how it ended (a fleet node's: its ranks, and where the others are)."""
    info = read_run(find_run(run, runs_dir), tuple(node_folders or ()))
    if as_json:
        _json(info.to_dict(detail=True))
        return
    console = out_console()
    console.print(f"[bold]{escape(info.name)}[/] {_status(info)}  run {escape(info.run_id or '-')}  "
                  f"{escape(str(info.path))}", highlight=False)
    if info.pid:
        console.print(f"pid {info.pid} ({escape(info.owner or '?')}) since {_when(info.started_at)}")
    if info.error:
        console.print(f"[red]error[/]: {escape(info.error)}", highlight=False)
    if info.nodes and (info.nodes["note"] or info.nodes["merged"]):
        console.print(escape(info.nodes["note"] or f"ranks {info.nodes['merged']} merged from "
                                                   f"{len(info.nodes['node_folders'])} other node folder(s)"),
                      highlight=False)
    s = info.settings
    if s:
        rounds = s.get("rounds")
        console.print(f"settings: {info.holders or '?'} holder{'s' * (info.holders != 1)}, {rounds} "
                      f"round{'s' * (rounds != 1)}, model "
                      f"{escape(info.model)}, "
                      f"data path {s.get('data_path')}, transport {s.get('transport')}, buffer {s.get('buffer_mib')} "
                      "MiB", highlight=False)
    state = info.state
    if state is not None and state.visits:
        table = Table(box=None, header_style="bold", pad_edge=False)
        from gputravel.console.view.model import gpu_label

        fleet = state.fleet  # a fleet's visits ran side by side: each names its GPU, in visit order
        for col in ("#", *(("gpu",) if fleet else ()), "holder", "try", "ep", "outcome", "loss", "val"):
            table.add_column(col, no_wrap=col != "outcome", overflow="fold")
        visits = sorted(state.visits.values(), key=lambda v: (v.visit, v.attempt)) if fleet else state.visits.values()
        uncommitted = _uncommitted(info)
        for v in visits:
            outcome = (f"refused (holder): {v.error}" if v.outcome == "refused" else
                       "interrupted (resumed)" if v.outcome == "interrupted" else
                       "done, not committed (--resume redoes it)" if v.visit in uncommitted and v.outcome == "done" else
                       v.outcome + (f" in {v.failed_phase}" if v.failed_phase else "")
                       + (f": {v.error}" if v.failed_phase and v.error else ""))  # a cancel has no error: no ": None"
            gpu = (gpu_label(v.gpu) if v.gpu is not None else "-",) if fleet else ()
            table.add_row(str(v.visit + 1), *gpu, escape(v.holder), str(v.attempt), str(v.epoch), escape(outcome),
                          f"{v.loss_last:.3f}" if v.loss_last is not None else "-",
                          f"{v.val_loss:.3f}" if v.val_loss is not None else "-")
        console.print(table)
    recordings = [str(path.relative_to(info.path)) for _, path in info.recordings if path.is_relative_to(info.path)]
    console.print(f"[dim]ledger {escape(str(info.ledger))}\nrecording{'s' * (len(recordings) > 1)} "
                  f"{escape(', '.join(recordings) or 'none (--no-record)')}[/]", highlight=False)


def _lines(info: RunInfo, *, follow: bool, interval: float) -> Iterator[tuple[int | None, Any, Any]]:
    """(fleet GPU or None, event, new OpLines) of the run's recordings (a fleet's: every rank's, merged in
    time order); with ``follow``, until the run is over."""
    from gputravel.console.view.model import RunState
    from gputravel.core.recording import load_recording

    address = RunAddress(str(info.path), info.path)
    if not address.recordings():
        if not follow:
            raise ConfigError(f"{info.path} has no recording (the run was started with --no-record)")
        while not address.recordings():
            if not _still_running(info):
                raise ConfigError(f"{info.path} has no recording and its run is not running")
            time.sleep(interval)
    state = RunState()
    seqs: dict[Path, int] = {}
    while True:
        fresh: list[tuple[float, int, int, int | None, Any]] = []
        for gpu, path in address.recordings():
            recording = load_recording(path, since_seq=seqs.get(path, 0))
            for item in recording.items:
                seqs[path] = item.seq
                if item.kind == "event":
                    fresh.append((item.t, -1 if gpu is None else gpu, item.seq, gpu, item.event()))
        fresh.sort(key=lambda x: x[:3])
        for *_, gpu, event in fresh:
            before = len(state.oplog)
            state.apply(event, gpu=gpu)
            new = list(state.oplog)[before:] if len(state.oplog) > before else []
            yield gpu, event, new
        if not follow or (state.ended and not address.fleet) or not _still_running(info):
            return
        time.sleep(interval)


def _still_running(info: RunInfo) -> bool:
    return driving_process(info.path) is not None and read_status(info.path).get("status") not in FINAL_STATUSES


@runs_app.command("log")
def log_cmd(run: RunArg, follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing as the run "
                                                                "goes, until it ends.")] = False,
            interval: Annotated[float, typer.Option(min=0.05, help="Seconds between reads with --follow.")] = 0.5,
            runs_dir: RunsDir = RUNS_DIR,
            as_json: Annotated[bool, typer.Option("--json", help="One JSON event per line (errors as JSON).")] = False,
            ) -> None:
    """The run's operations log (from its recording); --follow keeps reading until the run ends."""
    info = read_run(find_run(run, runs_dir))
    console = out_console(highlight=False)  # one event, one line: a pipe or a terminal wraps, not rich
    for gpu, event, lines in _lines(info, follow=follow, interval=interval):
        if as_json:
            typer.echo(json.dumps({**event.to_dict(), **({} if gpu is None else {"gpu": gpu})}, default=str))
            continue
        for line in lines:
            style = {"warn": "yellow", "error": "red"}.get(line.level, "")
            console.print(f"[{style}]{escape(line.stamped())}[/]" if style else escape(line.stamped()))
    if follow and not as_json:
        console.print(f"[dim]run {escape(info.name)}: {escape(read_run(info.path).status)}[/]")


@runs_app.command("stop")
def stop_cmd(run: RunArg,
             force: Annotated[bool, typer.Option("--force", help="Also stop a run driven by gputravel-console "
                                                 "(ends that console).")] = False,
             wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for the run to end.")] = 30.0,
             runs_dir: RunsDir = RUNS_DIR, as_json: AsJson = False) -> None:
    """Stop a running run: SIGTERM to its orchestrator, which cancels the run, scrubs and shuts the device down."""
    info = read_run(find_run(run, runs_dir))
    if info.status not in ("running", "paused") or info.pid is None:
        if read_marker(info.path).get("pid") is not None and info.status in ("died", "unknown", "not started"):
            signal_run(info.path, signal.SIGTERM, name=info.name)  # names why nothing is signalled
        raise ConfigError(f"run {info.name} is not running ({info.status})")
    if info.owner == "gputravel-console" and not force:
        raise ConfigError(f"run {info.name} is driven by gputravel-console (pid {info.pid}): cancel it there "
                          "with c, or pass --force to end that console")
    signal_run(info.path, signal.SIGTERM, name=info.name)  # only the process the run recorded
    deadline = time.monotonic() + wait
    while driving_process(info.path) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    after = read_run(info.path)
    out = {"name": info.name, "pid": info.pid, "signal": "SIGTERM", "stopped": after.status not in ("running", "paused"),
           "status": after.status}
    if as_json:
        _json(out)
    else:
        Console(highlight=False).print(f"run {escape(info.name)}: SIGTERM sent to pid {info.pid}; now "
                                       f"{escape(after.status)}")
    if after.status in ("running", "paused"):
        raise typer.Exit(1)


def _continue(run: str, runs_dir: Path, *, step: bool, as_json: bool) -> None:
    """Signal a paused headless run to go on: the whole way to its next breakpoint, or one phase."""
    from gputravel.console.cli.commands.run import RESUME_SIGNAL, STEP_SIGNAL

    info = read_run(find_run(run, runs_dir))
    if info.status not in ("paused", "running") or info.pid is None:
        raise ConfigError(f"run {info.name} is not running ({info.status}): nothing to continue")
    if info.owner != "gputravel run":
        raise ConfigError(f"run {info.name} is driven by {info.owner or 'another process'} (pid {info.pid}): "
                          "continue it there (the console: space or n)")
    sig = STEP_SIGNAL if step else RESUME_SIGNAL
    pid = signal_run(info.path, sig, name=info.name)  # only the process the run recorded
    out = {"name": info.name, "pid": pid, "signal": signal.Signals(sig).name, "action": "step" if step else "resume",
           "was": info.status}
    if as_json:
        _json(out)
    else:
        Console(highlight=False).print(f"run {escape(info.name)}: {out['action']} ({out['signal']} to pid {pid}); "
                                       f"was {escape(info.status)}")


@runs_app.command("resume")
def resume_cmd(run: RunArg, runs_dir: RunsDir = RUNS_DIR, as_json: AsJson = False) -> None:
    """Continue a paused headless run (gputravel run --break-before) to its next breakpoint (SIGUSR1)."""
    _continue(run, runs_dir, step=False, as_json=as_json)


@runs_app.command("step")
def step_cmd(run: RunArg, runs_dir: RunsDir = RUNS_DIR, as_json: AsJson = False) -> None:
    """Run one more phase of a paused headless run, then pause again (SIGUSR2)."""
    _continue(run, runs_dir, step=True, as_json=as_json)
