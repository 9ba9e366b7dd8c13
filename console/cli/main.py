"""The ``gputravel`` command line (headless batch mode).

Each command lives in its own module under ``console/commands`` and exposes ``register(app)``; a module is
imported only when its command runs (:class:`LazyCommandGroup`), so commands that need no model start fast.
Errors from the engine are ``GpuTravelError`` subclasses; ``main`` maps them to exit codes.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from typing import Any

import typer
import typer.main

from gputravel.console.cli.errors import (
    CTRL_C,
    REPORTED,
    ErrorReportingGroup,
    UsageProblem,
    error_envelope,
    fail,
    wants_json,
)
from gputravel.console.cli.options import fast_bool_flags, quiet_flag_types, version_callback
from gputravel.core.errors import GpuTravelError

__all__ = ["app", "error_envelope", "fail", "main", "wants_json"]

COMMAND_MODULES = ("run", "attest", "ledger", "data", "bench", "telemetry", "agents", "replay", "plan", "runs",
                   "export", "evidence", "fleet", "holder")

# What ``gputravel --help`` lists for each command: the first paragraph of its help, so that the root's help
# imports none of the command modules (loading them all took 1-8 s; torch came in through ``bench fleet``). A
# test keeps each line equal to its command's own help; a command missing here is loaded to list it.
COMMAND_SUMMARIES = {
    "run": "Run collaborative training: the GPU travels holder to holder (--gpus N: a fleet, docs/fleet.md).",
    "attest": "Attest the GPU: certificate chain, revocation, signature, nonce, measurements, CC mode.",
    "ledger": "Verify and inspect the hash-chained audit ledger.",
    "data": "Demo corpus and holder data folders.",
    "bench": "Benchmarks: JSON out, a rich table on screen, progress while running.",
    "telemetry": "GPU telemetry through NVML: utilisation, memory, power, clocks, PCIe, confidential-computing "
                 "state.",
    "agents": "Deploy, check and stop holder agents over SSH.",
    "replay": "Print a recorded run: every event and telemetry frame, and the state it ends in.",
    "plan": "Predict per-visit and whole-run transfer and training time for both data paths.",
    "runs": "Runs under runs/: list, show, follow the log, stop, resume or step a paused one.",
    "export": "Write a run's model: llm.c, GPT-2 safetensors, a Hugging Face folder (hf, LoRA merged) or peft.",
    "evidence": "Collateral for offline attestation: fetch what evidence needs and bundle it for an air-gapped holder.",
    "fleet": "A fleet over several nodes (docs/fleet.md).",
    "holder": "A data holder's own side: its configuration, restricted key and receipts.",
}


class LazyCommandGroup(ErrorReportingGroup):
    """The root group: each command's module (``console/cli/commands/<name>.py``, which exposes ``register(app)``
    and adds the command of its own name) is imported only when that command runs or help lists it, so
    ``gputravel --version`` and ``gputravel runs ls`` import no torch (a bench module does)."""

    _listing = False  # while the root's own help is drawn: commands are listed from COMMAND_SUMMARIES

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        if self._listing:
            return [*(n for n in COMMAND_MODULES if n in COMMAND_SUMMARIES or self.get_command(ctx, n) is not None),
                    *(n for n in self.commands if n not in COMMAND_MODULES)]
        return [*(n for n in COMMAND_MODULES if self.get_command(ctx, n) is not None),
                *(n for n in self.commands if n not in COMMAND_MODULES)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if self._listing and cmd_name not in self.commands and cmd_name in COMMAND_SUMMARIES:
            return typer.core.TyperCommand(cmd_name, help=COMMAND_SUMMARIES[cmd_name])  # a line of the list only
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            self._load(cmd_name)
        return self.commands.get(cmd_name)

    def _load(self, name: str) -> None:
        try:
            module = importlib.import_module(f"gputravel.console.cli.commands.{name}")
        except ModuleNotFoundError as exc:  # a command module not written yet must not break the others
            if exc.name != f"gputravel.console.cli.commands.{name}":
                raise
            return
        holder = typer.Typer()
        module.register(holder)
        self.commands.update(typer.main.get_group(holder).commands)


quiet_flag_types()
fast_bool_flags()
app = typer.Typer(
    name="gputravel",
    cls=LazyCommandGroup,  # commands load lazily; their errors are reported in one place (console/cli/errors.py)
    help="Confidential collaborative training with a travelling confidential GPU.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Confidential collaborative training with a travelling confidential GPU."""


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
        if isinstance(exc, UsageProblem) and isinstance(exc.exit_code, int):
            if wants_json() and not getattr(exc, REPORTED, False):
                fail(type(exc).__name__, exc.format_message(), exc.exit_code)
            exc.show()
            sys.exit(exc.exit_code)
        if wants_json():  # a bug: its traceback on stderr, and still the one JSON error object on stdout
            traceback.print_exc()
            fail(type(exc).__name__, f"internal error (a bug in gputravel): {exc}", 1)
        raise


if __name__ == "__main__":
    main()
