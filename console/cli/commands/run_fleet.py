"""``gputravel run --gpus N``: the fleet under torchrun, then the same report as a single GPU's, plus the fleet."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from gputravel.console.cli.run_end import ending_code
from gputravel.core.config import RunSettings
from gputravel.core.runfolder import write_status


def render_fleet(console: Console, report: dict[str, Any]) -> None:
    fleet = report["fleet"]
    ar = fleet["allreduce"]
    console.print(f"[bold]fleet[/]: {fleet['gpus']} GPUs ({', '.join(d['device_id'] for d in fleet['devices'])}), "
                  f"{fleet['rounds']} round(s) in {fleet['steps']} lock-step steps, {fleet['idle_slots']} idle slot(s)")
    for i, holders in enumerate(fleet["schedule"]):
        console.print(f"  step {i}: " + "  ".join(f"gpu{g}→{h or '(idle)'}" for g, h in enumerate(holders)))
    console.print(f"[bold]all-reduce[/]: {ar['variant']} ({'sealed' if ar['sealed'] else 'plaintext'}), "
                  f"{ar['calls']} calls, {ar['seconds']:.2f} s over all GPUs · replicas "
                  + ("[green]identical after every step[/]" if fleet["replica_digests_equal"] else "[red]DIVERGED[/]"))
    console.print(f"final model digest {fleet.get('final_model_digest')}")
    node = report.get("node")
    if node and node.get("note"):
        console.print(f"this node ran rank(s) {node['ranks']}; {node['note']}"
                      + ("; it keeps the fleet ledger" if node.get("fleet_ledger") else ""))


def run_fleet(settings: RunSettings, *, gpus: int, variant: str, nnodes: int, rdzv_endpoint: str | None,
              rdzv_id: str | None, max_restarts: int, as_json: bool, sim_pki: Path | None = None,
              join_timeout: float = 120.0) -> None:
    from gputravel.console.cli.run_report import EXIT_PARTIAL, render_report
    from gputravel.console.entries import launch_gpus
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import Rendezvous

    fleet = FleetOptions(gpus=gpus, variant=variant, join_timeout_s=join_timeout)
    rdzv = Rendezvous(nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=max_restarts,
                      sim_pki=sim_pki)
    console = Console(stderr=True) if as_json else Console()
    console.print(f"[bold]fleet[/] of {gpus} GPUs under torchrun ({nnodes} host(s)); ranks report below")
    try:
        report = launch_gpus(settings, fleet, rdzv=rdzv)
    except BaseException as exc:  # the fleet's own word on how it ended: status.json, as a single run's
        write_status(Path(settings.out_dir), "cancelled" if ending_code(exc) == "cancelled" else "failed",
                     error=str(exc) or type(exc).__name__, code=ending_code(exc))
        raise
    if not report.get("merged_elsewhere"):
        write_status(Path(settings.out_dir), "partial" if report.get("failed_visits") else "completed",
                     run_id=report.get("run_id"))
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif report.get("merged_elsewhere"):
        console.print(f"this host's ranks finished; {report['note']}")
    else:
        render_report(console, report)
        render_fleet(console, report)
    if report["failed_visits"]:
        raise typer.Exit(EXIT_PARTIAL)
