"""``gputravel bench fleet``: the fleet scaling study (``core.bench.fleet``), wired: options, progress, the
table or ``--json``.

``core.bench.fleet`` imports torch (through the fleet's rank), so it is imported when the study runs, not when
``gputravel --help`` or ``bench --help`` lists this command; ``DEFAULT_VARIANTS`` repeats its default (a test
keeps the two equal)."""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputravel.console.cli.commands.bench import StudyProgress, int_list
from gputravel.console.entries import launch_gpus
from gputravel.core.errors import ConfigError

DEFAULT_VARIANTS = ("secure_pipelined", "plain")  # core.bench.fleet.DEFAULT_VARIANTS, without importing torch


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def render(result: dict[str, Any], console: Console) -> None:
    job = result["job"]
    table = Table(title=f"bench fleet: {job['holders']} holders × {job['holder_kib']} KiB, {job['model']} model, "
                        f"batch {job['batch_size']}×{job['seq_len']}, {job['steps_per_visit']} steps per step "
                        f"({result['seconds']:.0f} s)")
    for col in ("GPUs", "all-reduce", "tokens/s", "efficiency", "all-reduce s", "share", "run s", "replicas"):
        table.add_column(col, justify="left" if col in ("all-reduce", "replicas") else "right")
    for r in result["rows"]:
        gpus = str(r["gpus"]) + (f" on {r['nnodes']} nodes" if r.get("nnodes", 1) > 1 else "")
        if r["status"] != "ok":
            table.add_row(gpus, r["variant"], f"[red]failed[/]: {r['reason']}", "", "", "", "", "")
            continue
        table.add_row(gpus, r["variant"], _f(r["tokens_per_s"], ",.0f"), _f(r["efficiency"], ".2f"),
                      _f(r["allreduce_s"], ".3f"), _f(r["allreduce_share"], ".1%"), _f(r["run_s"], ".1f"),
                      "equal" if r["replica_digests_equal"] else "[red]DIVERGED[/]")
    console.print(table)
    for s in result["sealed_vs_plain"]:
        console.print(f"{s['gpus']} GPUs: sealed ring all-reduce {_f(s['allreduce_s_over_plain'], '.1f')}x plain's "
                      f"time; plain trains {_f(s['tokens_per_s_plain_over_sealed'], '.2f')}x as many tokens/s")
    for s in result.get("nodes_vs_one", []):
        console.print(f"{s['gpus']} GPUs · {s['variant']}: {s['nnodes']} nodes sharing no folder train "
                      f"{_f(s['tokens_per_s_ratio'], '.2f')}x the tokens/s of one node")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("fleet")
    def fleet_cmd(
        gpus: str = typer.Option("1,2", "--gpus", help="GPU counts, comma-separated (e.g. 1,2,4)."),
        variants: str = typer.Option(",".join(DEFAULT_VARIANTS), "--variants",
                                     help="Gradient all-reduces to compare (secure_pipelined, secure_naive, ring, "
                                          "plain)."),
        holders: int = typer.Option(4, "--holders", min=1),
        holder_kib: int = typer.Option(96, "--holder-kib", min=8, help="KiB of data per holder."),
        steps_per_visit: int = typer.Option(4, "--steps-per-visit", min=1),
        batch_size: int = typer.Option(8, "--batch-size", min=1),
        seq_len: int = typer.Option(64, "--seq-len", min=8),
        model: str = typer.Option("tiny", "--model"),
        repeats: int = typer.Option(1, "--repeats", min=1, help="Runs per (GPUs, all-reduce); the median is kept."),
        nnodes: str = typer.Option("1", "--nnodes",
                                   help="Node counts, comma-separated: each N GPUs also as a fleet over H local "
                                        "nodes (own --out each, rendezvous on 127.0.0.1), beside one node."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    ) -> None:
        """A fleet of N GPUs: tokens/s, scaling efficiency, the sealed vs plain all-reduce's share of time."""
        from gputravel.core.bench import fleet  # torch: only when the study runs

        counts = int_list(gpus)
        names = tuple(v.strip() for v in variants.split(",") if v.strip())
        console = Console(stderr=True)
        progress = StudyProgress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("runs"), TimeElapsedColumn(), console=console)
        with tempfile.TemporaryDirectory(prefix="gputravel-bench-fleet-") as tmp, progress:
            try:
                result = fleet.study(counts, workdir=Path(tmp), variants=names, holders=holders,
                                     holder_kib=holder_kib, steps_per_visit=steps_per_visit, batch_size=batch_size,
                                     seq_len=seq_len, model=model, repeats=repeats, nnodes=int_list(nnodes),
                                     launch=partial(launch_gpus, quiet=True), on_progress=progress)
            except ConfigError as exc:
                raise typer.BadParameter(exc.reason) from None
        if as_json:
            render(result, console)
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result, Console())
