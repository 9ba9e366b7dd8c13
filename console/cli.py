"""The ``gputravel`` command line (headless batch mode).

Each command lives in its own module under ``console/commands`` and exposes ``register(app)``.
Errors from the engine are ``GpuTravelError`` subclasses; ``main`` maps them to exit codes.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from gputravel.console.options import quiet_flag_types, version_callback
from gputravel.core.errors import GpuTravelError

COMMAND_MODULES = ("run", "attest", "ledger", "data", "bench", "telemetry", "agents", "replay", "plan", "runs",
                   "export")

quiet_flag_types()
app = typer.Typer(
    name="gputravel",
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
        code = app(standalone_mode=False)
        if code == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into exit code 130
            fail("CancelledRunError", CTRL_C, 130)
        sys.exit(code if isinstance(code, int) else 0)
    except GpuTravelError as exc:
        fail(type(exc).__name__, exc.reason, exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("CancelledRunError", CTRL_C, 130)
    except Exception as exc:  # usage errors: click's, or the click that typer vendors (typer._click)
        if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
            if wants_json():
                fail(type(exc).__name__, exc.format_message() if hasattr(exc, "format_message") else str(exc),
                     exc.exit_code)
            exc.show()
            sys.exit(exc.exit_code)
        raise


CTRL_C = "cancelled (Ctrl-C); what was committed is kept: `gputravel run --resume` continues a run"


def wants_json(argv: list[str] | None = None) -> bool:
    """Whether the command line asked for ``--json`` (the error then goes to stdout as JSON too)."""
    return "--json" in (sys.argv[1:] if argv is None else argv)


def error_envelope(kind: str, message: str, exit_code: int) -> dict[str, object]:
    """What ``--json`` prints on stdout when a command fails, instead of a report or a traceback."""
    return {"ok": False, "error": {"type": kind, "message": message, "exit_code": exit_code}}


def fail(kind: str, message: str, exit_code: int) -> NoReturn:
    """Report a failure (on stderr; under ``--json`` also as an envelope on stdout) and exit with its code.
    The message is printed literally: rich markup in it (``[x]``) is escaped, never interpreted."""
    Console(stderr=True).print(f"[bold red]error[/]: {escape(kind)}: {escape(message)}", highlight=False,
                               soft_wrap=True)
    if wants_json():
        sys.stdout.write(json.dumps(error_envelope(kind, message, exit_code)) + "\n")
        sys.stdout.flush()
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
