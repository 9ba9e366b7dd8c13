"""``gputravel bench fleet-key``: the fleet-key agreement's time for W workers (``core.fleet.keybench``)."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("fleet-key")
    def fleet_key_cmd(
        workers: int = typer.Option(8, "--workers", min=2, help="Rank workers agreeing the key."),
        repeats: int = typer.Option(3, "--repeats", min=1),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """The fleet-key agreement (attested CVM quotes, verified by every worker, key wrapped by rank 0) for
        W worker processes on a local c10d store: ms from a common start to every worker's key."""
        from gputravel.core.fleet.keybench import bench_key_agreement

        result = bench_key_agreement(workers=workers, repeats=repeats)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        Console().print(f"fleet-key agreement, {workers} workers: median {result['fleet_ms_median']} ms "
                        f"(all: {result['fleet_ms_all']}) on {result['cpus']} CPUs; SIM CVM quotes")
