"""``gputravel bench allreduce``: every ring variant against ``dist.all_reduce``, in one run (the study:
``core.collectives.bench``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from gputravel.console.cli.commands.bench import float_list, int_list, machine_line, run_study
from gputravel.core.errors import ConfigError


def render(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="Ring all-reduce: median per call (slowest rank)", title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False)
    cells = []
    notes = []
    for r in report["rows"]:
        if r.get("note"):  # e.g. secure_gpu without a CUDA device at a large size: skipped
            notes.append(f"{r['variant']} at {r['size_mib']:g} MiB, world {r['world_size']}: {r['note']}")
            cells.append([str(r["world_size"]), f"{r['size_mib']:g}", r["variant"], r["gather"] or "",
                          *("-" for _ in range(10))])
            continue
        b = r["breakdown_s"]
        ratio = r["ratio_vs_plain"]
        cells.append([str(r["world_size"]), f"{r['size_mib']:g}", r["variant"], r["gather"] or "",
                      f"{r['median_s'] * 1e3:.2f}", f"{r['min_s'] * 1e3:.2f}",
                      f"{ratio:.2f}" if ratio is not None else "-",
                      f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else "-",
                      f"{r['bound_ratio']:.2f}" if r.get("bound_ratio") is not None else "-",
                      f"{r['fraction_of_bound']:.2f}" if r.get("fraction_of_bound") is not None else "-",
                      *(f"{b[k] * 1e3:.1f}" for k in ("crypto_s", "wire_s", "reduce_s", "wait_s"))])
    for i, col in enumerate(("world", "MiB", "variant", "gather", "median ms", "min ms", "× plain", "GB/s",
                             "bound", "of bound", "crypto", "wire", "reduce", "wait")):
        # variant names and figures are what a reader compares: never cut them; headers wrap instead
        table.add_column(col, justify="left" if col in ("variant", "gather") else "right",
                         min_width=max((len(row[i]) for row in cells), default=1))
    for r, row in zip(report["rows"], cells, strict=True):
        table.add_row(*row, style="bold green" if r["variant"] == "secure_pipelined" else None)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
    engines = sorted({r["cipher_engine"] for r in report["rows"] if r.get("cipher_engine") and not r.get("note")})
    if engines:
        console.print(f"secure_gpu hops sealed and opened by: {', '.join(engines)}")
    console.print("bound (× plain): plain plus the row's seal and open passes at the run's cipher speed; "
                  "of bound = bound/median")
    console.print("breakdown: ms per call, summed over threads (pipelined parts overlap); "
                  "[bold black on yellow] SIM [/] identities, real crypto")
    console.print(machine_line(report["machine"]))


def allreduce(
    world_size: Annotated[str, typer.Option("--world-size", help="Comma list of ranks per run, e.g. 2,4.")] = "2",
    size_mib: Annotated[str, typer.Option("--size-mib", help="Comma list of tensor sizes in MiB.")] = "1,16,64",
    variants: Annotated[str, typer.Option("--variants", help="'all' or a comma list of variants.")] = "all",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed calls per variant and size.")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed calls first.")] = 2,
    chunk_kib: Annotated[int, typer.Option(
        "--chunk-kib", min=0, help="Pipelined chunk size in KiB (0: auto).")] = 0,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=0, help="Crypto threads per rank (default: free cores; 0: inline).")] = None,
    gather: Annotated[str, typer.Option("--gather", help="All-gather of secure variants: sealed, reseal or both "
                                        "(sealed,reseal).")] = "sealed",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")] = "float32",
    backend: Annotated[str, typer.Option("--backend", help="gloo or nccl.")] = "gloo",
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Time plain, ring and secure all-reduce variants; ratios are against plain, measured in the same run."""
    from gputravel.core.collectives.bench import AllReduceSpec, parse_variants, run_allreduce_bench

    try:
        chosen = parse_variants(variants)
    except ConfigError as exc:
        raise typer.BadParameter(exc.reason) from None
    gathers = tuple(g.strip() for g in gather.split(",") if g.strip())
    if not gathers or any(g not in ("sealed", "reseal") for g in gathers):
        raise typer.BadParameter("--gather is sealed, reseal or sealed,reseal")
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("--dtype is float32 or bfloat16")
    worlds = int_list(world_size)
    spec = AllReduceSpec(sizes_mib=float_list(size_mib), variants=chosen, repeats=repeats, warmup=warmup,
                         chunk_bytes=chunk_kib * 1024 or None, workers=workers, gathers=gathers, dtype=dtype)
    run_study(lambda on_progress: run_allreduce_bench(spec, world_sizes=worlds, backend=backend,
                                                      on_progress=on_progress),
              worlds=worlds, steps=len(spec.sizes_mib) * (repeats + warmup),
              describe=lambda p: f"{p['size_mib']:g} MiB", render=render, json_out=json_out)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("allreduce")(allreduce)
