"""The ``gputravel`` command line (headless batch mode).

Each command lives in its own module under ``console/commands`` and exposes ``register(app)``.
Errors from the engine are ``GpuTravelError`` subclasses; ``main`` maps them to exit codes.
"""

from __future__ import annotations

import importlib
import sys

import typer

from gputravel.console.cli_errors import (
    CTRL_C,
    REPORTED,
    ErrorReportingGroup,
    error_envelope,
    fail,
    wants_json,
)
from gputravel.console.options import quiet_flag_types, version_callback
from gputravel.core.errors import GpuTravelError

__all__ = ["app", "error_envelope", "fail", "main", "wants_json"]

COMMAND_MODULES = ("run", "attest", "ledger", "data", "bench", "telemetry", "agents", "replay", "plan", "runs")

quiet_flag_types()
app = typer.Typer(
    name="gputravel",
    cls=ErrorReportingGroup,  # every command's errors are reported there, one shape (console/cli_errors.py)
    help="Confidential collaborative training with a travelling confidential GPU.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Confidential collaborative training with a travelling confidential GPU."""

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
        code = app(standalone_mode=False)  # a command's errors are reported by ErrorReportingGroup
        sys.exit(code if isinstance(code, int) else 0)
    except GpuTravelError as exc:
        fail(type(exc).__name__, exc.reason, exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("CancelledRunError", CTRL_C, 130)
    except Exception as exc:  # usage errors: click's, or the click that typer vendors (typer._click)
        if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
            if wants_json() and not getattr(exc, REPORTED, False):
                fail(type(exc).__name__, exc.format_message() if hasattr(exc, "format_message") else str(exc),
                     exc.exit_code)
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
