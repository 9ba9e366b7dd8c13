"""``gputravel ledger``: verify the audit ledger's hash chain and show its events.

Both commands open the ledger read-only. Exit codes: 0 intact, 8 (``LedgerError.exit_code``) when the
chain is broken, differs from a recorded head or the file is not a ledger; 2 (bad input) when there is no such
ledger or run, or a ``--head`` prefix that matches no row (a typo is not a tamper verdict).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from gputravel.console.cli.output import out_console
from gputravel.core.errors import ConfigError, LedgerError
from gputravel.core.ledger import (
    LedgerRow,
    VerifyResult,
    parse_head,
    read_rows,
    verify_ledger,
    witnessed_heads,
)
from gputravel.core.runfolder import RUN_ADDRESS_HELP, RUNS_DIR, RunAddress, resolve_run

ledger_app = typer.Typer(help="Verify and inspect the hash-chained audit ledger.", no_args_is_help=True)

PathArg = Annotated[str, typer.Argument(help="The ledger (a SQLite file) or its run: " + RUN_ADDRESS_HELP,
                                        metavar="LEDGER|RUN", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


@ledger_app.command("verify")
def verify(
    path: PathArg,
    as_json: JsonOpt = False,
    head: Annotated[str | None, typer.Option(
        "--head", metavar="SEQ:HASH",
        help="A head recorded earlier (gputravel run prints it): also find rows cut off the end or a rewritten "
             "chain. The hash may be shortened to an unambiguous prefix of 16+ hex digits (SEQ: optional).")] = None,
    witness: Annotated[Path | None, typer.Option(
        "--witness", metavar="FILE",
        help="A holder's witness file (the ledger head its agent was shown at each hand-off): every head in it "
             "must still be in the ledger, unchanged.")] = None,
    rank_ledgers: Annotated[list[Path] | None, typer.Option(
        "--rank-ledgers", metavar="DIR",
        help="A fleet checked from copies (its nodes share no folder): PATH is the fleet ledger (rank 0's node), "
             "each DIR a node's fleet folder or a rank-R folder; every rank the fleet ledger names must be "
             "given, and each must hold every head recorded for it. Repeat for each node.")] = None,
) -> None:
    """Recompute every row hash and chain link; exit 8 naming the first broken row."""
    address = ledger_address(path)
    try:
        witnessed = witnessed_heads(witness, run_id=_run_of(address.ledger)) if witness is not None else []
    except LedgerError as exc:
        raise typer.BadParameter(str(exc), param_hint="--witness") from exc
    if rank_ledgers:  # a fleet from copies of its nodes' folders
        from gputravel.core.fleet.verify import rank_ledgers as find_ranks
        from gputravel.core.fleet.verify import verify_fleet_ledger

        where = address.ledger
        expect = None
        dirs = [*rank_ledgers, *([address.folder] if address.fleet and address.folder is not None else [])]
        result = verify_fleet_ledger(where, find_ranks(dirs), complete=True)
    elif address.fleet and address.file is None:  # a fleet run: its ledger and every rank's
        from gputravel.core.fleet.verify import verify_fleet

        assert address.folder is not None
        expect = None
        result = verify_fleet(address.folder)
        where = address.folder
    else:
        where = address.ledger
        try:
            expect = head_from_text(head, where) if head is not None else None
        except LedgerError as exc:
            raise typer.BadParameter(exc.reason, param_hint="--head") from exc
        if head is not None and expect is None:  # a prefix without SEQ that fits no row: say so, no verdict
            raise ConfigError(f"--head {head.strip()}: no row of {where} has a hash that starts with it; check the "
                              f"head you gave (`gputravel ledger verify RUN` prints this ledger's). To check a "
                              f"head recorded earlier against the chain, give it whole (SEQ:HASH): a row "
                              f"that differs is then exit 8")
        result = verify_ledger(where, expect_head=expect, expect_heads=witnessed)
    if not result.ok:
        raise broken(result, where)
    if as_json:
        typer.echo(json.dumps(asdict(result), indent=2))
        return
    checked = f", contains the recorded head {expect[0]}" if expect else ""
    if witnessed:
        checked += f", holds all {len(set(witnessed))} witnessed heads"
    console = out_console()
    console.print(f"[green]ledger intact[/]: {result.rows} rows{checked}; head:", soft_wrap=True)
    # the head alone on its line, never wrapped or styled, so a terminal copies it whole
    console.print(f"{result.rows}:{result.head_hash}" if result.head_hash else "none (empty)", soft_wrap=True,
                  highlight=False, markup=False)


def _run_of(ledger: Path) -> str | None:
    """The run id of a ledger's rows (a witness keeps heads per run), or None when it cannot be read (the
    verification then names why)."""
    try:
        rows = read_rows(ledger, limit=1)
    except LedgerError:
        return None
    return rows[0].run_id if rows else None


#: the shortest hash prefix ``--head`` takes: 16 hex digits (64 bits), too many to grind a rewritten row
#: whose hash starts the same way
MIN_HEAD_PREFIX = 16


def head_from_text(text: str, ledger: Path) -> tuple[int, str] | None:
    """``--head`` as ``(seq, hash)``: ``SEQ:HASH`` as printed, or with the hash shortened to an unambiguous
    prefix of at least 16 hex digits (``SEQ:PREFIX``, or ``PREFIX`` alone, looked up among the rows). With
    ``SEQ``, a prefix that fits no row is kept, so the check fails naming that row; without, None."""
    seq_text, sep, digest = text.strip().rpartition(":") if ":" in text else ("", "", text.strip())
    digest = digest.lower()
    if len(digest) == 64 and sep:
        return parse_head(text)
    if len(digest) < MIN_HEAD_PREFIX or any(c not in "0123456789abcdef" for c in digest) or \
            (sep and (not seq_text.isdigit() or int(seq_text) < 1)):
        raise LedgerError(f"a ledger head is SEQ:HASH, SEQ:PREFIX or PREFIX (a hash prefix of at least "
                          f"{MIN_HEAD_PREFIX} hex digits), not {text!r}")
    want = int(seq_text) if sep else None
    try:
        rows = read_rows(ledger)
    except LedgerError:
        rows = []
    fits = [r for r in rows if r.hash.startswith(digest) and (want is None or r.seq == want)]
    if len(fits) > 1:
        raise LedgerError(f"head prefix {digest} is ambiguous: rows {', '.join(str(r.seq) for r in fits)}")
    if fits:
        return fits[0].seq, fits[0].hash
    return None if want is None else (want, digest)


def ledger_address(given: str) -> RunAddress:
    """The run ``given`` names (any run address, or a ledger file).

    Raises:
        ConfigError: (exit 2) nothing by that name: no file, no run (it names the path it looked for), or a
            run folder without a ledger. A file that is there but is not a ledger stays the ledger's own error
            (exit 8).
    """
    try:
        address = resolve_run(given)
    except ConfigError as exc:
        path = Path(given).expanduser()
        if path.exists():
            address = RunAddress(given, None, path)
        elif exc.reason.startswith("no run "):  # one sentence for both readings: the path, and the run's name
            under = "" if "/" in given else f" and no run {given!r} under {RUNS_DIR}/"
            raise ConfigError(f"no ledger or run {given!r}: {path.absolute()} does not exist{under} (a ledger "
                              "file, a run folder, a recording, or a run's name: gputravel runs ls lists them)"
                              ) from None
        else:  # an ambiguous name, no latest run: the resolver's own words
            raise
    if not (address.fleet and address.file is None) and not address.ledger.exists():
        raise ConfigError(f"{address.ledger}: no ledger there (the run did not write one)")
    return address


def broken(result: VerifyResult, path: Path) -> LedgerError:
    """The error a broken chain is reported as (exit 8): the reason and the last good row; under ``--json``
    the verification result's fields come with the error object."""
    last = f"; last good row {result.rows}, hash {result.head_hash}" if result.head_hash is not None else ""
    what = "ledger broken: " if path.exists() else ""
    error = LedgerError(f"{what}{result.reason or 'unknown reason'}{last}")
    error.detail = asdict(result)
    return error


@ledger_app.command("show")
def show(
    path: PathArg,
    as_json: JsonOpt = False,
    holder: Annotated[str | None, typer.Option("--holder", help="Only this holder's events.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=0, help="At most N rows, the most recent.")
    ] = None,
) -> None:
    """List the ledger's events (seq, time, kind, phase, holder, epoch, key fp, bytes, duration, outcome)."""
    ledger = ledger_address(path).ledger
    rows = read_rows(ledger, holder=holder, limit=limit)  # LedgerError: reported by the CLI, exit 8
    error = refusal_if_broken(ledger)
    if as_json:
        if error is not None:  # one JSON object: the error, with the rows as they are
            error.detail = {"rows": [row.to_dict() for row in rows]}
            raise error
        typer.echo(json.dumps([row.to_dict() for row in rows], indent=2, ensure_ascii=False))
        return
    console = out_console()
    console.print(_table(rows, ledger, width=console.width))
    if error is not None:
        raise error


def refusal_if_broken(path: Path) -> LedgerError | None:
    """Rows are shown as they are, but a ledger whose chain does not verify is never passed off as a good
    one: the break is named and the command exits 8 (as ``ledger verify`` does)."""
    result = verify_ledger(path)
    if result.ok:
        return None
    error = broken(result, path)
    error.reason += " (these rows cannot be trusted)"
    return error


def _table(rows: list[LedgerRow], path: Path, *, width: int = 200) -> Table:
    """One line per row at any width: below 120 columns the time loses its date (the title keeps it) and
    the key fingerprint shortens; below 100 the duration goes; long names end in an ellipsis, never wrap."""
    narrow, tiny = width < 120, width < 100
    day = datetime.fromtimestamp(rows[0].ts, tz=UTC).strftime("%Y-%m-%d") if rows and narrow else ""
    table = Table(
        title=escape(f"{path} ({len(rows)} rows{', ' + day + ' UTC' if day else ''})"),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("seq", justify="right", no_wrap=True, min_width=max(3, len(str(rows[-1].seq)) if rows else 3))
    table.add_column("time" if narrow else "time (UTC)", no_wrap=True, min_width=8 if narrow else 19)  # whole
    table.add_column("kind", no_wrap=True, overflow="ellipsis", max_width=13 if narrow else None)
    table.add_column("phase", no_wrap=True, overflow="ellipsis", min_width=5)
    table.add_column("holder", no_wrap=True, overflow="ellipsis", max_width=12 if narrow else None)
    table.add_column("ep", justify="right", no_wrap=True, min_width=2)
    table.add_column("key fp", no_wrap=True, min_width=8 if narrow else 12)
    table.add_column("bytes", justify="right", no_wrap=True, min_width=9)
    if not tiny:
        table.add_column("secs", justify="right", no_wrap=True, min_width=5)
    table.add_column("outcome", no_wrap=True, overflow="ellipsis", max_width=12 if narrow else None)
    for row in rows:
        when = datetime.fromtimestamp(row.ts, tz=UTC)
        cells = [
            str(row.seq),
            when.strftime("%H:%M:%S" if narrow else "%Y-%m-%d %H:%M:%S"),
            escape(row.kind),
            _text(row.phase),
            _text(row.holder),
            _text(row.epoch),
            _text(row.key_fp[: 8 if narrow else 12] if row.key_fp else None),
            _bytes(row.nbytes),
            *([] if tiny else ["-" if row.duration_s is None else f"{row.duration_s:.3f}"]),
            f"[green]{escape(row.outcome)}[/]" if row.outcome == "ok" else f"[red]{escape(row.outcome)}[/]",
        ]
        table.add_row(*cells)
    return table


def _text(value: object) -> str:
    return "-" if value is None else escape(str(value))


def _bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if abs(nbytes) < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if abs(size) < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} TiB"


def register(app: typer.Typer) -> None:
    """Add the ``ledger`` command group to ``app``."""
    app.add_typer(ledger_app, name="ledger")
