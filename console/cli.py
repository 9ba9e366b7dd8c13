"""The ``gputravel`` command line (headless batch mode).

Each command lives in its own module under ``console/commands`` and exposes ``register(app)``.
Errors from the engine are ``GpuTravelError`` subclasses; ``main`` maps them to exit codes.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from gputravel.core.errors import GpuTravelError

COMMAND_MODULES = ("run", "attest", "ledger", "data", "bench", "telemetry", "agents", "replay", "plan")

app = typer.Typer(
    name="gputravel",
    help="Confidential collaborative training with a travelling confidential GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"gputravel.console.commands.{_name}")
    except ModuleNotFoundError as exc:  # a command module not written yet must not break the others
        if exc.name != f"gputravel.console.commands.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    """Entry point: run the typer app, turning gputravel errors into documented exit codes."""
    try:
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except GpuTravelError as exc:
        Console(stderr=True).print(f"[bold red]error[/]: {exc}")
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # usage errors: click's, or the click that typer vendors (typer._click)
        if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
