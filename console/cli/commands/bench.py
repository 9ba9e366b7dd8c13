"""``gputravel bench ...``: benchmarks that write JSON (never timed assertions in tests).

Each benchmark lives in its own module ``console/cli/commands/bench_<name>.py`` exposing
``register(bench_app)``; a module not written yet is simply absent. The studies themselves are in
``core/bench`` (and ``core/collectives/bench.py``); here is the wiring they share: progress bars fed by a
study's callbacks, and the option lists of the collectives studies.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

BENCH_MODULES = ("provision", "travel", "allreduce", "ddp", "load", "soak", "gpu_aes", "fleet", "checkpoint", "train",
                 "evidence", "hostile", "fleet_key")

bench_app = typer.Typer(help="Benchmarks: JSON out, a rich table on screen, progress while running.",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(f"gputravel.console.cli.commands.bench_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"gputravel.console.cli.commands.bench_{name}":
                raise
            continue
        module.register(bench_app)
    app.add_typer(bench_app, name="bench")


# --- progress --------------------------------------------------------------------------------------------
class StudyProgress:
    """One transient rich bar fed by a study's ``on_progress(description, done, total)``; it appears with
    the first report, so a study that has nothing to measure shows none."""

    def __init__(self, *columns: str | ProgressColumn, console: Console) -> None:
        self._progress = Progress(*columns, console=console, transient=True)
        self._task: Any = None

    def __call__(self, description: str, done: int, total: int) -> None:
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(description, total=max(total, 1))
        self._progress.update(self._task, description=description, completed=done, total=max(total, 1))

    def __enter__(self) -> StudyProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


# --- the collectives studies (bench allreduce, bench ddp) ------------------------------------------------
def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"expected a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter("values must be positive")
    return values


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"expected a comma list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter("values must be positive")
    return values


def machine_line(machine: dict[str, Any]) -> str:
    return (f"machine: {machine['cores']} cores ({machine['cpu']}), device {machine['device']}, "
            f"backend {machine['backend']}, torch {machine['torch']}, gloo_tls "
            f"{'available' if machine['gloo_tls'] else 'not in this build'}")


def run_study(run: Callable[[Callable[[int, dict[str, Any]], None]], dict[str, Any]], *, worlds: tuple[int, ...],
              steps: int, describe: Callable[[dict[str, Any]], str],
              render: Callable[[Console, dict[str, Any]], None], json_out: bool) -> None:
    """One bar per world size while ``run(on_progress)`` goes, then the table (stderr with --json) and the
    JSON report on stdout."""
    console = Console(stderr=json_out)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        tasks = [progress.add_task(f"world {w}", total=steps) for w in worlds]

        def on_progress(i: int, payload: dict[str, Any]) -> None:
            progress.update(tasks[i], completed=payload["done"],
                            description=f"world {payload['world_size']} · {describe(payload)}")

        report = run(on_progress)
    render(console, report)
    if json_out:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
