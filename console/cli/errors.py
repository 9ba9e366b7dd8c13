"""How every ``gputravel`` command fails: one place, one shape.

A command raises a :class:`GpuTravelError` (or a usage error) and returns nothing else; the root command group
(:class:`ErrorReportingGroup`, the ``cls`` of the CLI's typer app) catches it for every command and subcommand,
prints ``error: <Type>: <message>`` on stderr and, when the command line holds ``--json``, one JSON object on
stdout::

    {"ok": false, "error": {"type": "ConfigError", "code": "config", "message": "...", "exit_code": 2}}

then exits with the error's documented exit code. An error may carry ``detail`` (a dict, e.g. ``ledger verify``'s
result): its fields sit next to ``ok`` and ``error`` in the same object. Typer's ``CliRunner`` goes through the
same group, so tests see what a shell sees. Cheap to import: no engine, no torch.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn, Protocol, runtime_checkable

import typer
import typer.core
from rich.console import Console
from rich.markup import escape

from gputravel.core.errors import GpuTravelError

__all__ = ["JSON_META", "ErrorReportingGroup", "UsageProblem", "error_envelope", "fail", "report_error", "wants_json"]

#: ``ctx.meta`` key: the command line asked for ``--json``
JSON_META = "gputravel.json"
#: set on an exception whose report was already printed (the fallback in ``cli.main`` must not print it again)
REPORTED = "_gputravel_reported"


@runtime_checkable
class UsageProblem(Protocol):
    """A usage error as click raises it (or the click typer vendors, another class of the same shape): it shows
    itself, with its exit code."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...
CTRL_C = "cancelled (Ctrl-C); what was committed is kept: `gputravel run --resume` continues a run"


def wants_json(argv: list[str] | None = None) -> bool:
    """Whether the command line asked for ``--json`` (the error then goes to stdout as JSON too)."""
    args = sys.argv[1:] if argv is None else argv
    return "--json" in args[: args.index("--")] if "--" in args else "--json" in args


def error_envelope(kind: str, message: str, exit_code: int, *, code: str | None = None,
                   detail: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``--json`` prints on stdout when a command fails, instead of a report or a traceback."""
    error: dict[str, Any] = {"type": kind, "message": message, "exit_code": exit_code}
    if code is not None:
        error["code"] = code
    out: dict[str, Any] = {k: v for k, v in (detail or {}).items() if k not in ("ok", "error")}
    return {"ok": False, "error": error, **out}


def report_error(kind: str, message: str, exit_code: int, *, as_json: bool, code: str | None = None,
                 detail: dict[str, Any] | None = None) -> None:
    """Print a failure: one line on stderr (the message literally: rich markup in it is escaped), and under
    ``--json`` the envelope on stdout."""
    Console(stderr=True).print(f"[bold red]error[/]: {escape(kind)}: {escape(message)}", highlight=False,
                               soft_wrap=True)
    if as_json:
        sys.stdout.write(json.dumps(error_envelope(kind, message, exit_code, code=code, detail=detail),
                                    default=str) + "\n")
        sys.stdout.flush()


def report_exception(exc: GpuTravelError, *, as_json: bool) -> None:
    report_error(type(exc).__name__, exc.reason, exc.exit_code, as_json=as_json, code=exc.code, detail=exc.detail)


def fail(kind: str, message: str, exit_code: int) -> NoReturn:
    """Report a failure found outside a command (``cli.main``'s fallback) and exit with its code."""
    report_error(kind, message, exit_code, as_json=wants_json())
    sys.exit(exit_code)


class ErrorReportingGroup(typer.core.TyperGroup):
    """The CLI's root group: every command's ``GpuTravelError`` and usage error is reported here."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        as_json = wants_json(list(args))
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[JSON_META] = as_json
        return ctx

    def invoke(self, ctx: Any) -> Any:
        as_json = bool(ctx.meta.get(JSON_META))
        try:
            return super().invoke(ctx)
        except GpuTravelError as exc:
            report_exception(exc, as_json=as_json)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            report_error("CancelledRunError", CTRL_C, 130, as_json=as_json, code="cancelled")
            raise typer.Exit(130) from None
        except Exception as exc:  # usage errors: the click typer vendors (typer._click)
            if (as_json and isinstance(exc, UsageProblem) and isinstance(exc.exit_code, int)
                    and not getattr(exc, REPORTED, False)):
                sys.stdout.write(json.dumps(error_envelope(type(exc).__name__, exc.format_message(), exc.exit_code,
                                                           code="usage")) + "\n")
                sys.stdout.flush()
                setattr(exc, REPORTED, True)
            raise
