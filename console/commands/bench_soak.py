"""``gputravel bench soak``: many visits on the emulated platform; memory and overhead stay flat.

Four holders (local agent subprocesses, direct data path), a tiny model, one training step per
visit, a 64 KiB buffer: ``rounds = ceil(visits / 4)``. After every visit the resident set of the
orchestrator, the device service and the agents is read from /proc. Reported:

* memory growth after warm-up: the median of the last 10% of visits against the median of the
  10%..20% stretch (the first 10% is warm-up: allocator pools, torch caches); target ≤ 5%, flat;
* protocol overhead per visit (as in ``bench load``: everything but PROVISION, TRAIN and the sealed
  checkpoint), first 10% of visits against the last 10%: it must not grow with the ledger;
* the ledger verifies at the end (every row's hash chain).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from gputravel.console.commands.bench_load import (
    OVERHEAD_TARGET_MS,
    anon_rss,
    cost_summary,
    mib,
    rss,
    run_probed,
    stats_ms,
    write_holders,
)
from gputravel.core.machine import machine_info

GROWTH_TARGET = 0.05
#: Resident set per process, and its anonymous part (heap and stacks: what a leak grows; RSS also counts
#: pages of mapped files, such as the ledger's SQLite WAL index, and shared libraries as they are touched).
ROLES = ("orchestrator", "device", "agents", "total",
         "orchestrator_anon", "device_anon", "agents_anon", "total_anon")
HOLDERS = 4


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def growth(series: list[int]) -> dict[str, Any]:
    """Growth of a per-visit series after warm-up (first 10%): last 10% against the 10%..20% stretch."""
    n = len(series)
    if n < 10:
        return {"baseline_mib": None, "final_mib": None, "growth": None}
    d = n // 10
    base = _median([float(x) for x in series[d: 2 * d]])
    final = _median([float(x) for x in series[-d:]])
    peak_after = max(series[d:])
    return {"baseline_mib": mib(base), "final_mib": mib(final), "peak_after_warmup_mib": mib(peak_after),
            "growth": round((final - base) / base, 4) if base else None}


async def soak(*, visits: int, holder_kib: int, workdir: Path, console: Console | None = None) -> dict[str, Any]:
    from gputravel.core import events as ev
    from gputravel.core.config import RunSettings

    rounds = math.ceil(visits / HOLDERS)
    data = write_holders(workdir / "data", HOLDERS, holder_kib * 1024, seed=7)
    settings = RunSettings(holders=HOLDERS, rounds=rounds, steps_per_visit=1, batch_size=4, seq_len=32, chunk_kib=16,
                           buffer_mib=max(0.0625, 2 * holder_kib / 1024), data_dir=data, out_dir=workdir / "run",
                           transport="local", data_path="direct", model="tiny")
    samples: list[dict[str, int]] = []
    engine_ref: list[Any] = []
    progress = Progress(TextColumn("soak"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console or Console(stderr=True),
                        transient=True)
    task = progress.add_task("visits", total=rounds * HOLDERS, info="")

    def sink(event: Any) -> None:
        if not isinstance(event, ev.VisitCompleted | ev.VisitFailed):
            return
        engine = engine_ref[0]
        agent_pids = [getattr(link, "proc", None) and link.proc.pid for link in engine.links.values()]
        row = {"visit": event.visit, "orchestrator": rss(os.getpid()), "device": rss(engine.handle.pid),
               "agents": sum(rss(pid) for pid in agent_pids),
               "orchestrator_anon": anon_rss(os.getpid()), "device_anon": anon_rss(engine.handle.pid),
               "agents_anon": sum(anon_rss(pid) for pid in agent_pids)}
        row["total"] = row["orchestrator"] + row["device"] + row["agents"]
        row["total_anon"] = row["orchestrator_anon"] + row["device_anon"] + row["agents_anon"]
        samples.append(row)
        progress.update(task, advance=1, info=f"{mib(row['total']):,.0f} MiB")

    t0 = time.perf_counter()
    with progress:
        report, probe, _engine = await run_probed(settings, links=None, sinks=[sink], on_engine=engine_ref.append)
    total_s = time.perf_counter() - t0
    costs = probe.visit_costs(report)
    d = max(1, len(costs) // 10)
    first, last = [c["overhead"] for c in costs[:d]], [c["overhead"] for c in costs[-d:]]
    first_ms, last_ms = _median(first) * 1e3, _median(last) * 1e3
    mem = {role: growth([s[role] for s in samples]) for role in ROLES}
    for role, g in mem.items():
        series = [s[role] for s in samples]
        g["by_decile_mib"] = [mib(_median([float(x) for x in series[i * len(series) // 10: (i + 1) * len(series) // 10]]))
                              for i in range(10)] if len(series) >= 10 else []
    deciles = [round(_median([c["overhead"] for c in costs[i * len(costs) // 10: (i + 1) * len(costs) // 10]]) * 1e3, 2)
               for i in range(10)] if len(costs) >= 10 else []
    worst = max((m["growth"] for m in mem.values() if m["growth"] is not None), default=None)
    return {
        "benchmark": "soak",
        "machine": machine_info(),
        "settings": {"visits_asked": visits, "visits": len(report["visits"]), "holders": HOLDERS, "rounds": rounds,
                     "steps_per_visit": 1, "model": settings.model, "holder_kib": holder_kib,
                     "buffer_kib": settings.buffer_bytes // 1024, "transport": "local", "data_path": "direct"},
        "memory": {**mem, "target_growth": GROWTH_TARGET,
                   "within_target": worst is not None and worst <= GROWTH_TARGET,
                   "method": "RSS (statm) and its anonymous part (RssAnon) per visit from /proc; growth = median "
                             "of the last 10% of visits over the median of visits 10%..20% (the first 10% is "
                             "warm-up)"},
        "overhead": {"first_10pct_median_ms": round(first_ms, 2), "last_10pct_median_ms": round(last_ms, 2),
                     "ratio_last_to_first": round(last_ms / first_ms, 3) if first_ms else None,
                     "by_decile_median_ms": deciles, "target_ms": OVERHEAD_TARGET_MS,
                     "within_target": max(first_ms, last_ms) <= OVERHEAD_TARGET_MS, **cost_summary(costs)},
        "checkpoint_first_last_ms": [stats_ms(c["checkpoint"] for c in costs[:d])["median"],
                                     stats_ms(c["checkpoint"] for c in costs[-d:])["median"]],
        "outcomes": {"done": sum(1 for v in report["visits"] if v["outcome"] == "done"),
                     "failed": report["failed_visits"]},
        "ledger": {k: report["ledger"][k] for k in ("verified", "rows", "reason")},  # verified by the engine
        "seconds": round(total_s, 2),
        "visits_per_s": round(len(costs) / total_s, 2) if total_s else None,
    }


def render_soak(result: dict[str, Any]) -> None:
    s, m, o = result["settings"], result["memory"], result["overhead"]
    table = Table(title=f"bench soak: {s['visits']} visits, {s['holders']} holders, tiny model "
                        f"({result['seconds']:.0f} s, {result['visits_per_s']} visits/s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for role in ROLES:
        g = m[role]
        if g["growth"] is None:
            continue
        name = f"anonymous RSS {role.removesuffix('_anon')}" if role.endswith("_anon") else f"RSS {role}"
        table.add_row(f"{name} after warm-up → end", f"{g['baseline_mib']:,.1f} → {g['final_mib']:,.1f} MiB "
                      f"({g['growth']:+.1%})", f"≤ {m['target_growth']:.0%}")
    table.add_row("protocol overhead, first 10% → last 10%",
                  f"{o['first_10pct_median_ms']:.1f} → {o['last_10pct_median_ms']:.1f} ms",
                  f"≤ {o['target_ms']:.0f} ms {'✓' if o['within_target'] else '✗'}")
    if o["by_decile_median_ms"]:
        table.add_row("  by decile (median ms)", " ".join(f"{x:.0f}" for x in o["by_decile_median_ms"]), "")
    table.add_row("sealed checkpoint, first → last", " → ".join(f"{x:.0f}" for x in result["checkpoint_first_last_ms"])
                  + " ms", "")
    table.add_row("ledger", f"{'verified' if result['ledger']['verified'] else 'BROKEN'} "
                  f"({result['ledger']['rows']:,} rows)", "")
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("soak")
    def soak_cmd(
        visits: int = typer.Option(1000, "--visits", min=10, help="Visits (4 holders, ceil(visits/4) rounds)."),
        holder_kib: int = typer.Option(12, "--holder-kib", min=1, help="Synthetic text per holder (KiB)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Many visits with a tiny model: memory growth after warm-up, overhead over time, ledger at the end."""
        console = Console(stderr=True)
        with tempfile.TemporaryDirectory(prefix="gputravel-soak-") as tmp:
            result = asyncio.run(soak(visits=visits, holder_kib=holder_kib, workdir=Path(tmp), console=console))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render_soak(result)
