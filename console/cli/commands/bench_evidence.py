"""``gputravel bench evidence``: the cost of checking GPU (SPDM + RIMs) and CVM (TDX quote, SEV-SNP report, Azure's
HCL report + TPM quote) evidence, wired:
options, the table or ``--json`` (the study: ``core.bench.evidence``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"bench evidence: {result['platform']} [SIM], {result['rounds']} rounds")
    for col in ("check", "median ms", "p90 ms"):
        table.add_column(col, justify="left" if col == "check" else "right")
    for name, t in result["timings"].items():
        table.add_row(name, f"{t['median_ms']:.2f}", f"{t['p90_ms']:.2f}")
    console.print(table)
    console.print(f"per visit (GPU report + TDX quote): {result['per_visit_ms']:.2f} ms "
                  f"(target <= {result['per_visit_target_ms']} ms)")
    snp = result["snp"]
    console.print(f"SEV-SNP rows (whole verifications, target <= {snp['target_verification_ms']} ms): "
                  "snp_report_real_milan is virtee's real report (not SIM); the others are SIM")
    for note in snp["notes"]:
        console.print(f"  {note}")
    mem = result["memory"]
    console.print(f"memory decoding hex at the {mem['cap_bytes']:,}-byte cap: {mem['decode_at_cap_peak_bytes']:,} "
                  f"bytes ({mem['ratio_to_size']}x its size; limits {mem['target_ratio']}x and "
                  f"{mem['target_max_bytes']:,} bytes)")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("evidence")
    def evidence_cmd(
        rounds: int = typer.Option(50, "--rounds", min=1, help="Timed repetitions of each check."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    ) -> None:
        """Time the checks of SIM evidence in NVIDIA's and Intel's formats (same code as for real evidence)."""
        from gputravel.core.bench import evidence  # the verifiers: when the study runs, not for --help

        with Console(stderr=True).status("checking SIM GPU and TDX evidence"):
            result = evidence.study(rounds=rounds)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result)
