"""``gputravel bench ...``: benchmarks that write JSON (never timed assertions in tests).

Each benchmark lives in its own module ``console/commands/bench_<name>.py`` exposing
``register(bench_app)``; a module not written yet is simply absent.
"""

from __future__ import annotations

import importlib

import typer

BENCH_MODULES = ("provision", "travel", "allreduce", "ddp", "load", "soak", "gpu_aes")

bench_app = typer.Typer(help="Benchmarks: JSON out, a rich table on screen, progress while running.",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(f"gputravel.console.commands.bench_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"gputravel.console.commands.bench_{name}":
                raise
            continue
        module.register(bench_app)
    app.add_typer(bench_app, name="bench")
