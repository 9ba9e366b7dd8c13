"""``gputravel bench gpu-aes``: AES-256-GCM on the GPU (seal, open) by message size against one CPU core.

The study lives in ``core.bench.gpu_aes``; this module parses options and renders.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

MIB = 1 << 20
DEFAULT_SIZES = "64K,1M,16M,64M,256M"  # core.bench.gpu_aes.DEFAULT_SIZES (numpy: not for --help)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``64K,1M,256M`` or plain byte counts."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in (p.strip().upper().removesuffix("IB").removesuffix("B") for p in text.split(",")):
        if not part:
            continue
        scale = units.get(part[-1], 1)
        try:
            value = int(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            raise typer.BadParameter(f"expected sizes like 64K,1M,256M, got {text!r}") from None
        if value < 1:
            raise typer.BadParameter("sizes must be positive")
        out.append(value)
    if not out:
        raise typer.BadParameter("no sizes given")
    return tuple(out)


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(console: Console, r: dict[str, Any]) -> None:
    table = Table(title=f"AES-256-GCM on the GPU ({r['backend']})", title_justify="left")
    for col in ("message", "chunks", "seal GB/s", "open GB/s", "open × 1 CPU core"):
        table.add_column(col, justify="right")
    for row in r["rows"]:
        table.add_row(f"{row['size_bytes'] / 1024:g} KiB", str(row["chunks"]), fmt(row["seal_gb_s"]),
                      fmt(row["open_gb_s"]), fmt(row["open_vs_cpu_1core"]))
    console.print(table)
    console.print(f"vectors {r['vectors_passed']}/{r['vectors_total']} passed, interop with cryptography "
                  f"{'ok' if r['interop_ok'] else 'FAILED'}; one CPU core: {r['cpu_1core_gb_s']:.2f} GB/s")
    if r["note"]:
        console.print(f"[bold black on yellow] NOTE [/] {r['note']}")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("gpu-aes")
    def gpu_aes_cmd(
        sizes: str = typer.Option(DEFAULT_SIZES, "--sizes",
                                  help="Message sizes, e.g. 64K,1M,256M."),
        batch_mib: int = typer.Option(256, "--batch-mib", min=1, help="Bytes per timed batch (MiB)."),
        repeats: int = typer.Option(5, "--repeats", min=1),
        all_vectors: bool = typer.Option(False, "--all-vectors", help="Every 96-bit-IV CAVP record (minutes "
                                                                      "in the simulator)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Seal/open GB/s on the GPU by message size next to one CPU core.

        Known-answer vectors and interop with cryptography are checked first (the simulator without a GPU:
        correctness only)."""
        from gputravel.core.bench.gpu_aes import run

        size_list = parse_sizes(sizes)
        console = Console(stderr=True)
        with console.status("gpu-aes") as status:
            report = run(sizes=size_list, batch_bytes=batch_mib * MIB, repeats=repeats, all_vectors=all_vectors,
                         progress=lambda msg: status.update(msg))
        failed = report["vectors_passed"] != report["vectors_total"] or not report["interop_ok"]
        if failed and as_json:  # the one JSON error object, the report in it
            from gputravel.core.errors import GpuTravelError

            error = GpuTravelError(f"the GPU cipher failed its checks: {report['vectors_passed']} of "
                                   f"{report['vectors_total']} known-answer vectors, interop "
                                   f"{'ok' if report['interop_ok'] else 'FAILED'}")
            error.detail = report
            raise error
        if as_json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
        else:
            render(Console(), report)
        if failed:
            raise typer.Exit(1)
