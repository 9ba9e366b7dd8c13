"""``gputravel bench ddp``: per-iteration DDP training time with each comm hook (the GPU-TEE study's table; the
study: ``core.collectives.bench``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gputravel.console.cli.commands.bench import int_list, machine_line, run_study
from gputravel.core.collectives.models import MODELS
from gputravel.core.errors import ConfigError


def render(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="DDP training: median time per iteration (slowest rank)", title_justify="left")
    for col in ("world", "model", "params", "hook", "median ms", "min ms", "× plain", "× noop",
                "crypto", "wire", "reduce", "wait"):
        table.add_column(col, justify="left" if col in ("model", "hook") else "right")
    for r in report["rows"]:
        b = r["comm_breakdown_s"]
        table.add_row(str(r["world_size"]), r["model"], f"{r['params'] / 1e6:.1f} M", r["variant"],
                      f"{r['median_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}", f"{r['ratio_vs_plain']:.2f}",
                      f"{r['ratio_vs_noop']:.2f}" if r["ratio_vs_noop"] else "-",
                      *(f"{b[k] * 1e3:.1f}" for k in ("crypto_s", "wire_s", "reduce_s", "wait_s")),
                      style="bold green" if r["variant"] == "secure_pipelined" else None)
    console.print(table)
    console.print("plain = DDP's own all-reduce; noop = no communication (compute only); breakdown: ms of "
                  "communication per iteration; [bold black on yellow] SIM [/] identities emulated, crypto real")
    console.print(machine_line(report["machine"]))


def ddp(
    world_size: Annotated[str, typer.Option("--world-size", help="Comma list of ranks per run, e.g. 2,4.")] = "2",
    model: Annotated[str, typer.Option("--model", help=f"Comma list of model sizes ({', '.join(MODELS)}).")] = "S,M",
    variants: Annotated[str, typer.Option("--variants", help="'all' or a comma list of hook variants.")] = "all",
    iters: Annotated[int, typer.Option("--iters", min=1, help="Timed iterations per hook.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed iterations first.")] = 2,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Samples per rank per iteration.")] = 32,
    chunk_kib: Annotated[int, typer.Option(
        "--chunk-kib", min=0, help="Pipelined chunk size in KiB (0: auto).")] = 0,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=0, help="Crypto threads per rank (default: free cores; 0: inline).")] = None,
    backend: Annotated[str, typer.Option("--backend", help="gloo or nccl.")] = "gloo",
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Train an MLP with DDP under each hook; overhead by world size and model size, in one run."""
    from gputravel.core.collectives.bench import DdpSpec, parse_variants, run_ddp_bench

    try:
        chosen = parse_variants(variants, hooks=True)
    except ConfigError as exc:
        raise typer.BadParameter(exc.reason) from None
    models = tuple(m.strip() for m in model.split(",") if m.strip())
    if not models or any(m not in MODELS for m in models):
        raise typer.BadParameter(f"--model takes a comma list of {', '.join(MODELS)}")
    worlds = int_list(world_size)
    spec = DdpSpec(models=models, variants=chosen, iters=iters, warmup=warmup, batch=batch,
                   chunk_bytes=chunk_kib * 1024 or None, workers=workers)
    run_study(lambda on_progress: run_ddp_bench(spec, world_sizes=worlds, backend=backend, on_progress=on_progress),
              worlds=worlds, steps=len(models) * (iters + warmup), describe=lambda p: f"model {p['model']}",
              render=render, json_out=json_out)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("ddp")(ddp)
