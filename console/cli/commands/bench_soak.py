"""``gputravel bench soak``: the wiring (options, the progress bar, the table); the study itself is
``gputravel.core.bench.soak``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gputravel.console.cli.commands.bench import StudyProgress
from gputravel.console.entries import ENTRIES


def soak_progress(console: Console) -> StudyProgress:
    """The soak's bar: visits done of those expected, and the total resident set after the last one."""
    return StudyProgress(TextColumn("soak"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                         TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def render_soak(result: dict[str, Any], console: Console | None = None) -> None:
    from gputravel.core.bench.soak import ROLES  # the engine: when a table is drawn, not for --help

    s, m, o = result["settings"], result["memory"], result["overhead"]
    table = Table(title=f"bench soak: {s['visits']} visits, {s['holders']} holders, tiny model "
                        f"({result['seconds']:.0f} s, {result['visits_per_s']} visits/s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for role in ROLES:
        g = m[role]
        if g["growth"] is None:
            continue
        name = f"anonymous RSS {role.removesuffix('_anon')}" if role.endswith("_anon") else f"RSS {role}"
        table.add_row(f"{name} after warm-up → end", f"{g['baseline_mib']:,.1f} → {g['final_mib']:,.1f} MiB "
                      f"({g['growth']:+.1%})", f"≤ {m['target_growth']:.0%}")
    table.add_row("protocol overhead, first 10% → last 10%",
                  f"{o['first_10pct_median_ms']:.1f} → {o['last_10pct_median_ms']:.1f} ms",
                  f"≤ {o['target_ms']:.0f} ms {'✓' if o['within_target'] else '✗'}")
    if o["by_decile_median_ms"]:
        table.add_row("  by decile (median ms)", " ".join(f"{x:.0f}" for x in o["by_decile_median_ms"]), "")
    table.add_row("sealed checkpoint, first → last", " → ".join(f"{x:.0f}" for x in result["checkpoint_first_last_ms"])
                  + " ms", "")
    table.add_row("ledger", f"{'verified' if result['ledger']['verified'] else 'BROKEN'} "
                  f"({result['ledger']['rows']:,} rows)", "")
    (console or Console()).print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("soak")
    def soak_cmd(
        visits: int = typer.Option(1000, "--visits", min=10, help="Visits (4 holders, ceil(visits/4) rounds)."),
        holder_kib: int = typer.Option(12, "--holder-kib", min=1, help="Synthetic text per holder (KiB)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Many visits with a tiny model: memory growth after warm-up, overhead over time, ledger at the end."""
        import asyncio  # here, not for --help (issue 35.4: bench --help <= 0.5 s)

        from gputravel.core.bench.soak import soak

        console = Console(stderr=True)
        with tempfile.TemporaryDirectory(prefix="gputravel-soak-") as tmp, soak_progress(console) as progress:
            result = asyncio.run(soak(visits=visits, holder_kib=holder_kib, workdir=Path(tmp), entries=ENTRIES,
                                      on_progress=progress))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render_soak(result)
