"""``gputravel plan``: predict a run's transfer and training time on both data paths (``core.bench.plan``).

The model is fitted on measured runs: ``--from FILE.json`` (outputs of ``bench travel --json`` and/or
``bench provision --json``, repeatable). Without ``--from`` it uses the calibration cached under the user
cache dir (``<cache>/gputravel/plan-calibration.json``) when it was measured on this machine, or runs a short
calibration (two small ``bench travel`` studies, about a minute) and caches it; ``--recalibrate`` forces one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gputravel.console.cli.commands.bench_travel import travel_progress
from gputravel.core.errors import ConfigError


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}%" if x >= 0.1 else f"{x:.3f}%"


def _secs(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:,.2f} h"
    if x >= 60:
        return f"{x / 60:,.1f} min"
    return f"{x:,.3f} s" if x < 10 else f"{x:,.1f} s"


def _err(e: dict[str, Any]) -> str:
    return "—" if e.get("mape") is None else f"{e['mape']:.1%} (max {e['max_ape']:.1%})"


def render(result: dict[str, Any], console: Console) -> None:
    pred = result["prediction"]
    holders = ", ".join(f"{b / 2**30:,.2f} GiB" for b in result["holder_bytes"])
    table = Table(title=f"plan: holders {holders}; buffer {result['buffer_mib']:g} MiB; {pred['visits']} visits, "
                        f"{pred['bytes'] / 2**30:,.2f} GiB moved, {pred['steps']:,} steps "
                        f"({pred['steps_per_mib']:g} steps/MiB)"
                        + (f"; link {pred['gbps']:g} Gb/s" if pred.get("gbps") else ""))
    for col in ("path", "visit tx", "visit train", "visit tx %", "run tx", "run train", "run total",
                "run tx %", "MB/s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for path, p in pred["paths"].items():
        v, r = p["visit"], p["run"]
        table.add_row(path, _secs(v["tx_s"]), _secs(v["train_s"]), _pct(v["tx_pct"]), _secs(r["tx_s"]),
                      _secs(r["train_s"]), _secs(r["total_s"]), _pct(r["tx_pct"]),
                      "—" if p["mb_s"] is None else f"{p['mb_s']:,.0f}")
    console.print(table)
    if "conventional_over_travelling_tx" in pred:
        console.print(f"conventional / travelling transfer time: {pred['conventional_over_travelling_tx']:.1f}x")
    model = result["model"]
    fit = Table(title="model (fitted on whole runs; error: leave-one-run-out, predicted vs measured)")
    for col in ("term", "coefficients", "runs", "fit error", "held-out error"):
        fit.add_column(col, justify="left" if col in ("term", "coefficients") else "right")
    for name, t in [*((f"transfer {p}", t) for p, t in model["transfer"].items()), ("train (both paths)",
                                                                                    model["train"])]:
        if t is None:
            continue
        a, b = t["coef"]
        unit = "byte" if t["features"][1] == "bytes" else "step"
        per = f"{b * 1e9:,.3f} ns/byte ({1 / b / 1e6:,.0f} MB/s)" if unit == "byte" and b > 0 else \
            f"{b * 1e3:,.2f} ms/step" if unit == "step" else "0 per byte"
        coefs = f"{a * 1e3:,.1f} ms/visit + {per}"
        fit.add_row(name, coefs + (f" [dim]({t['note']})[/]" if t.get("note") else ""), str(t["n"]),
                    _err(t["fit_error"]), _err(t["loo_error"]))
    console.print(fit)
    console.print(f"measured runs: {result['source']}")
    for job in model["jobs"][:1]:
        console.print(f"training predictions are for the measured job: {job.get('model')} model, batch "
                      f"{job.get('batch_size')}×{job.get('seq_len')}, on the machine it was measured on.")
    if len(model["jobs"]) > 1:
        console.print(f"[yellow]warning[/]: the runs come from {len(model['jobs'])} different jobs; the training "
                      "fit mixes them.")


def render_fleet(fleet: dict[str, Any], console: Console) -> None:
    p, one = fleet["prediction"], fleet["one_gpu"]
    console.print(f"[bold]fleet[/]: {p['gpus']} GPUs × {p['holders']} holders, {p['steps']} lock-step steps "
                  f"({p['idle_slots']} idle slots): transfer {_secs(p['tx_s'])}, training {_secs(p['train_s'])}, "
                  f"{fleet['variant']} all-reduce {_secs(p['allreduce_s'])} ({_pct(p['allreduce_pct'])}); "
                  f"total {_secs(p['total_s'])} vs {_secs(one['total_s'])} on one GPU "
                  f"({one['total_s'] / p['total_s']:.2f}x)" if p["total_s"] else "")
    t = fleet["allreduce"]
    console.print(f"all-reduce fit: {t['coef'][0] * 1e3:.2f} ms/step + {t['coef'][1] * 1e3:.2f} ms per ring step "
                  f"over {t['n']} run(s), held-out error {_err(t['loo_error'])}")


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        holder_bytes: str = typer.Option(..., "--holder-bytes", help="Each holder's data, comma-separated: "
                                         "10G,20G,5G (K/M/G/T: powers of 1024; KB/MB/GB/TB: of 1000)."),
        buffer_mib: float = typer.Option(256.0, "--buffer-mib", help="GPU data buffer (MiB)."),
        gbps: float | None = typer.Option(None, "--gbps", help="Link bandwidth (Gb/s) instead of the measured "
                                          "rate: Travelling overlaps it with decryption, the conventional path "
                                          "adds it."),
        from_files: list[Path] = typer.Option([], "--from", help="bench travel / bench provision JSON; "
                                              "repeatable."),
        steps_per_mib: float | None = typer.Option(None, "--steps-per-mib",
                                                   help="Training steps per MiB (default: the measured job's)."),
        rounds: int = typer.Option(1, "--rounds"),
        recalibrate: bool = typer.Option(False, "--recalibrate", help="Measure a fresh calibration (no --from)."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
        gpus: int = typer.Option(1, "--gpus", min=1, help="A fleet of N GPUs (docs/fleet.md): needs a 'bench fleet "
                                 "--json' output among --from for the all-reduce."),
        fleet_allreduce: str = typer.Option("secure_pipelined", "--fleet-allreduce",
                                            help="The fleet's all-reduce to predict (its measured rows)."),
        steps_per_visit: int = typer.Option(20, "--steps-per-visit", min=1,
                                            help="A fleet's optimizer steps per lock-step step."),
    ) -> None:
        """Predict per-visit and whole-run transfer and training time for both data paths."""
        from gputravel.core.bench.plan import (
            plan,  # the planner and its calibration: when it runs, not for --help
        )
        from gputravel.core.sizes import parse_sizes

        console = Console(stderr=True)
        try:
            sizes = parse_sizes(holder_bytes)
        except ConfigError as exc:
            raise typer.BadParameter(exc.reason, param_hint="--holder-bytes") from None
        if not (0 < buffer_mib <= 64 * 1024):
            raise typer.BadParameter("must be in (0, 65536]", param_hint="--buffer-mib")
        if gbps is not None and not gbps > 0:
            raise typer.BadParameter("must be positive", param_hint="--gbps")
        if steps_per_mib is not None and not steps_per_mib > 0:
            raise typer.BadParameter("must be positive", param_hint="--steps-per-mib")
        if rounds < 1:
            raise typer.BadParameter("must be >= 1", param_hint="--rounds")
        from gputravel.console import holders as holder_set

        try:
            with travel_progress(console) as progress:
                result = plan(sizes, buffer_mib=buffer_mib, from_files=from_files, gbps=gbps,
                              steps_per_mib=steps_per_mib, rounds=rounds, recalibrate=recalibrate, run=holder_set.run,
                              say=console.print, on_progress=progress, gpus=gpus,
                              fleet_variant=fleet_allreduce, steps_per_visit=steps_per_visit)
        except ConfigError as exc:
            raise typer.BadParameter(exc.reason) from None
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result, Console())
        if "fleet" in result:
            render_fleet(result["fleet"], Console())
