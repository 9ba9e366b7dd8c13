"""``gputravel bench load``: the wiring (options, the loopback SSH server, progress, the table); the
study itself is ``gputravel.core.bench.load``."""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputravel.console.cli.commands.bench import int_list

if TYPE_CHECKING:  # the engine is imported when a study runs, not for --help
    from gputravel.core.travel.holders import HolderLink

#: the most holders one ``bench load`` run starts
MAX_HOLDERS = 512


class SshHolders:
    """The embedded loopback SSH server with one account per holder (``bench load``'s ``HolderServer``)."""

    def __init__(self, holders: list[tuple[str, Path]], workdir: Path | None, *, data_route: str = "forward") -> None:
        from gputravel.agents.ssh_links import EmbeddedSshServer

        self.server = EmbeddedSshServer(holders, workdir=workdir, data_route=data_route)

    def start(self) -> list[HolderLink]:
        from gputravel.agents.ssh_links import links_from_specs

        return list(links_from_specs(self.server.start()))

    def stop(self) -> None:
        self.server.stop()


def ssh_holders(holders: list[tuple[str, Path]], workdir: Path | None, /, *, data_route: str = "forward") -> SshHolders:
    return SshHolders(holders, workdir, data_route=data_route)


def render_load(result: dict[str, Any], console: Console | None = None) -> None:
    s, d, pv, m = result["settings"], result["deploy"], result["per_visit"], result["memory"]
    table = Table(title=f"bench load: {s['holders']} holders × {s['rounds']} rounds over loopback SSH "
                        f"({s['visits']} visits, {result['seconds']:.1f} s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row(f"deploy, {s['holders']} agents in parallel (wall)", f"{d['wall_s']:.2f} s",
                  f"≤ {d['target_s']:.0f} s {'✓' if d['within_target'] else '✗'}")
    table.add_row("protocol overhead / visit (median)", f"{pv['protocol_overhead_ms']['median']:.1f} ms",
                  f"≤ {pv['target_overhead_ms']:.0f} ms {'✓' if pv['within_target'] else '✗'}")
    table.add_row("protocol overhead / visit (p95)", f"{pv['protocol_overhead_ms']['p95']:.1f} ms", "")
    for phase, ms in pv["overhead_by_phase_median_ms"].items():
        table.add_row(f"  {phase}", f"{ms:.2f} ms", "")
    table.add_row("sealed checkpoint / visit (median)", f"{pv['checkpoint_ms']['median']:.1f} ms", "")
    table.add_row("ledger + events / visit (median)", f"{pv['bookkeeping_ms']['median']:.1f} ms", "")
    table.add_row("provision / train (median)", f"{pv['provision_ms']['median']:.1f} / "
                  f"{pv['train_ms']['median']:.1f} ms", "")
    for role, v in m["peak_mib"].items():
        table.add_row(f"peak RSS: {role}", f"{v:,.1f} MiB", "")
    table.add_row("ledger", "verified" if result["ledger"]["verified"] else "BROKEN", "")
    out = console or Console()
    out.print(table)
    if len(result.get("rows", [])) > 1:
        rows = Table(title="the orchestrator by holder count")
        for col in ("holders", "ms / visit", "RSS MB", "open fds"):
            rows.add_column(col, justify="right")
        for r in result["rows"]:
            rows.add_row(str(r["holders"]), f"{r['orchestrator_ms_per_visit']:.2f}", f"{r['rss_mb']:.1f}",
                         str(r["open_fds"]))
        out.print(rows)
        g = result.get("growth") or {}
        if g:
            out.print(f"from {g['from_holders']} to {g['to_holders']} holders: ms / visit ×"
                      f"{g['orchestrator_ms_per_visit_ratio']}, {g['rss_mb_per_added_holder']} MB and "
                      f"{g['open_fds_per_added_holder']} descriptors per added holder")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("load")
    def load_cmd(
        holders: str = typer.Option("16", "--holders", help="Holders, or a comma list of holder counts (e.g. "
                                    "8,32,128): one run each, a row each (1..512)."),
        rounds: int = typer.Option(2, "--rounds", min=1),
        holder_kib: int = typer.Option(12, "--holder-kib", min=1, help="Synthetic text per holder (KiB)."),
        steps_per_visit: int = typer.Option(1, "--steps-per-visit", min=1),
        transport: str = typer.Option("ssh", "--transport", help="ssh (accounts on the loopback SSH server) or "
                                      "local (agent subprocesses)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Deploy N agents in parallel over loopback SSH and run their visits.

        Deploy time, per-visit protocol overhead, peak memory; with several holder counts, a row per count
        (the orchestrator's ms per visit, RSS and open descriptors) and how they grow."""
        import asyncio  # here, not for --help (issue 35.4: bench --help <= 0.5 s)

        from gputravel.console.entries import ENTRIES
        from gputravel.core.bench.load import growth, load

        try:
            counts = int_list(holders)
        except typer.BadParameter as exc:
            raise typer.BadParameter(str(exc), param_hint="--holders") from None
        if not counts or not all(1 <= n <= MAX_HOLDERS for n in counts):
            raise typer.BadParameter(f"holder counts must be in 1..{MAX_HOLDERS}", param_hint="--holders")
        if transport not in ("ssh", "local"):
            raise typer.BadParameter("transport is ssh or local", param_hint="--transport")
        results = []
        for n in counts:
            progress = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            deploy_task = progress.add_task(f"starting {n} agents", total=n)
            visit_task = progress.add_task("visits", total=n * rounds)
            with tempfile.TemporaryDirectory(prefix="gputravel-load-") as tmp, progress:
                results.append(asyncio.run(load(holders=n, rounds=rounds, holder_kib=holder_kib,
                                                steps_per_visit=steps_per_visit, workdir=Path(tmp),
                                                server=ssh_holders, entries=ENTRIES, transport=transport,
                                                on_deployed=partial(progress.advance, deploy_task),
                                                on_visit=partial(progress.advance, visit_task))))
        # the largest count's full report, every count's row, and how the rows grow
        result = {**results[-1], "rows": [r for res in results for r in res["rows"]]}
        result["growth"] = growth(result["rows"])
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render_load(result)
