"""``gputravel bench load``: the wiring (options, the loopback SSH server, progress, the table); the
study itself is ``gputravel.core.bench.load``."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputravel.console.entries import ENTRIES

if TYPE_CHECKING:  # the engine is imported when a study runs, not for --help
    from gputravel.core.travel.holders import HolderLink


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
    (console or Console()).print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("load")
    def load_cmd(
        holders: int = typer.Option(16, "--holders", min=1, max=64, help="Holder accounts on the loopback SSH server."),
        rounds: int = typer.Option(2, "--rounds", min=1),
        holder_kib: int = typer.Option(12, "--holder-kib", min=1, help="Synthetic text per holder (KiB)."),
        steps_per_visit: int = typer.Option(1, "--steps-per-visit", min=1),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Deploy N agents in parallel over loopback SSH and run their visits.

        Deploy time, per-visit protocol overhead, peak memory."""
        from gputravel.core.bench.load import load

        progress = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        deploy_task = progress.add_task("deploying agents", total=holders)
        visit_task = progress.add_task("visits", total=holders * rounds)
        with tempfile.TemporaryDirectory(prefix="gputravel-load-") as tmp, progress:
            result = asyncio.run(load(holders=holders, rounds=rounds, holder_kib=holder_kib,
                                      steps_per_visit=steps_per_visit, workdir=Path(tmp), server=ssh_holders,
                                      entries=ENTRIES,
                                      on_deployed=lambda: progress.advance(deploy_task),
                                      on_visit=lambda: progress.advance(visit_task)))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render_load(result)
