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
        repeats: int = typer.Option(3, "--repeats", min=1, help="Timed agreements (after one warm-up)."),
        every_quote_in_full: bool = typer.Option(
            False, "--every-quote-in-full",
            help="Check every quote with dcap-qvl in full, not a platform's once per agreement (the baseline)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """The fleet-key agreement of W rank workers on a local c10d store: ms from the first hello to every key.

        The workers start once and agree a fresh key 1 + R times; each worker's attested CVM quote is verified
        by every other worker, and rank 0 wraps the key for each."""
        from gputravel.core.fleet.keybench import bench_key_agreement

        result = bench_key_agreement(workers=workers, repeats=repeats, by_family=not every_quote_in_full)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result, Console())


def render(result: dict[str, Any], console: Console) -> None:
    """A row per timed agreement (ms from the first hello to every worker's key, the slowest worker's), then the
    median and the start-up costs kept out of it."""
    table = Table(title=f"Fleet-key agreement: {result['workers']} workers on {result['cpus']} CPUs")
    for name in ("run", "ms to every key", "release to last key", "CPU ms, all workers", "full / reused checks"):
        table.add_column(name, justify="right")
    for i, run in enumerate(result["runs"], 1):
        table.add_row(str(i), f"{run['fleet_ms']:.1f}", f"{run['release_to_last_key_ms']:.1f}",
                      f"{run['cpu_ms_all_workers']:.1f}", f"{run['verify_full']} / {run['verify_reused']}")
    console.print(table)
    start = result["start"]
    console.print(f"median {result['fleet_ms_median']} ms (warm-up {result['warmup']['fleet_ms']} ms); the "
                  f"workers' CPU, summed: {result['cpu_ms_all_workers_median']} ms (load {result['load_avg_1m']}); "
                  f"start-up, not timed: all ready in {start['all_ready_s']} s (a worker's import "
                  f"{start['import_cpu_s_median']} s CPU, its CVM {start['cvm_cpu_s_median']} s); {result['note']}")
