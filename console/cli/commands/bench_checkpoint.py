"""``gputravel bench checkpoint``: seal + write and read + open + load of a model's state through the device
link (``core.bench.checkpoint``), wired: options, a status line, the table or ``--json``."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gputravel.core.errors import ConfigError


def _mib(x: int | None) -> str:
    return "N/A" if x is None else f"{x / 2**20:,.1f} MiB"


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    job = result["job"]
    table = Table(title=f"bench checkpoint: {job['model']} ({job['params']:,} parameters), state "
                        f"{_mib(result['state_bytes'])} in {result['chunks']} chunks, on {job['device']}")
    for col in ("step", "MB/s", "seconds", "orchestrator peak", "device peak"):
        table.add_column(col, justify="left" if col == "step" else "right")
    table.add_row("seal + write", f"{result['seal_mb_s']:,.0f}", f"{result['seal_s']:.2f}",
                  _mib(result["orchestrator_peak_rss_over_baseline_bytes"]),
                  _mib(result["device_peak_rss_over_baseline_bytes"]))
    table.add_row("read + open + load", f"{result['restore_mb_s']:,.0f}", f"{result['restore_s']:.2f}",
                  _mib(result["restore_orchestrator_peak_rss_over_baseline_bytes"]),
                  _mib(result["restore_device_peak_rss_over_baseline_bytes"]))
    table.add_row("device's seal alone", f"{result['device_seal_mb_s'] or 0:,.0f}", f"{result['device_seal_s']:.2f}",
                  "", "")
    table.add_row("plain write, then fsync (best)", f"{result['disk_write_mb_s']:,.0f}", "", "", "")
    table.add_row("plain write, writeback as it goes (best)", f"{result['disk_write_writeback_mb_s']:,.0f}", "", "",
                  "")
    table.add_row("AES-256-GCM, 1 core", f"{result['aes_gcm_1core_mb_s']:,.0f}", "", "", "")
    console.print(table)
    console.print(f"seal + write = {result['fraction_of_bound']} of the bound, the faster plain write + fsync "
                  f"({result['bound_write']}; target >= 0.9; each round: "
                  f"{[row['fraction_of_bound'] for row in result['rows']]}); the device's seal = "
                  f"{result['device_seal_pct_of_aes_1core']} % of one core's AES-GCM (target >= 50); orchestrator "
                  f"peak = {result['orchestrator_peak_pct_of_state']} % of the state (target <= 25).")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("checkpoint")
    def checkpoint_cmd(
        model: str = typer.Option("gpt2", "--model", help="tiny, small or gpt2 (GPT-2 124M)."),
        chunk_kib: int = typer.Option(4096, "--chunk-kib", help="Plaintext KiB per sealed chunk."),
        device: str | None = typer.Option(None, "--device", help="torch device (default: cuda if present)."),
        torch_threads: int = typer.Option(0, "--torch-threads", help="Device threads (0: torch's default)."),
        rounds: int = typer.Option(3, "--rounds", min=1, help="Alternating rounds of plain write and seal."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    ) -> None:
        """Seal + write and read + open + load of a model's checkpoint, with peak memory on both sides."""
        from gputravel.core.bench import checkpoint  # torch: only when the study runs, not for --help

        err = Console(stderr=True)
        try:
            with err.status(f"checkpointing a {model} model through the device link"):
                result = checkpoint.study(model=model, device=device, chunk_size=chunk_kib * 1024,
                                          torch_threads=torch_threads, rounds=rounds)
        except ConfigError as exc:
            raise typer.BadParameter(exc.reason) from None
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result)
