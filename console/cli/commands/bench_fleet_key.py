"""``gputravel bench fleet-key``: the fleet-key agreement's time for W workers (``core.fleet.keybench``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("fleet-key")
    def fleet_key_cmd(
        workers: int = typer.Option(8, "--workers", min=2, help="Rank workers agreeing the key."),
        repeats: int = typer.Option(3, "--repeats", min=1),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """The fleet-key agreement of W rank workers on a local c10d store: ms until every worker has the key.

        Each worker's attested CVM quote is verified by every worker, and rank 0 wraps the key for each."""
        from gputravel.core.fleet.keybench import bench_key_agreement

        result = bench_key_agreement(workers=workers, repeats=repeats)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result, Console())


def render(result: dict[str, Any], console: Console) -> None:
    """A row per agreement (ms from a common start to every worker's key), then the median."""
    table = Table(title=f"Fleet-key agreement: {result['workers']} workers on {result['cpus']} CPUs")
    table.add_column("run", justify="right")
    table.add_column("ms to every key", justify="right")
    for i, ms in enumerate(result["fleet_ms_all"], 1):
        table.add_row(str(i), f"{ms:.1f}")
    console.print(table)
    console.print(f"median {result['fleet_ms_median']} ms; the workers' CPU, summed: "
                  f"{result.get('cpu_ms_all_workers_median', '?')} ms (load {result.get('load_avg_1m', '?')}); "
                  f"{result['note']}")
