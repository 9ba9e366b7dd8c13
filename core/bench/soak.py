"""``bench soak``'s study: many visits on the emulated platform; memory and overhead stay flat.

Four holders (local agent subprocesses, direct data path), a tiny model, one training step per
visit, a 64 KiB buffer: ``rounds = ceil(visits / 4)``. After every visit the resident set of the
orchestrator, the device service and the agents is read from /proc. Reported:

* memory growth after warm-up: the median of the last 10% of visits against the median of the
  10%..20% stretch (the first 10% is warm-up: allocator pools, torch caches); target ≤ 5%, flat;
* protocol overhead per visit (as in ``bench load``: everything but PROVISION, TRAIN and the sealed
  checkpoint), first 10% of visits against the last 10%: it must not grow with the ledger;
* the ledger verifies at the end (every row's hash chain).

Progress goes to ``on_progress(description, visits done, visits expected)``, as in ``bench travel``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from gputravel.core import events as ev
from gputravel.core.bench.load import OVERHEAD_TARGET_MS, cost_summary, run_probed, stats_ms, write_holders
from gputravel.core.bench.procmem import anon_rss, mib, rss
from gputravel.core.bench.travel import ProgressFn
from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.machine import machine_info
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.local_link import LocalHolderLink

__all__ = ["GROWTH_TARGET", "HOLDERS", "ROLES", "growth", "soak"]

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


def _sample(visit: int, engine: TravelEngine) -> dict[str, int]:
    """The resident set (and its anonymous part) of each role, read from /proc after one visit."""
    agent_pids = [link.proc.pid if isinstance(link, LocalHolderLink) and link.proc is not None else None
                  for link in engine.links.values()]
    me, device = os.getpid(), engine.device.handle.pid
    row = {"visit": visit, "orchestrator": rss(me), "device": rss(device),
           "agents": sum(rss(pid) for pid in agent_pids),
           "orchestrator_anon": anon_rss(me), "device_anon": anon_rss(device),
           "agents_anon": sum(anon_rss(pid) for pid in agent_pids)}
    row["total"] = row["orchestrator"] + row["device"] + row["agents"]
    row["total_anon"] = row["orchestrator_anon"] + row["device_anon"] + row["agents_anon"]
    return row


def _deciles(series: list[float]) -> list[float]:
    """The median of each tenth of a series (empty below ten values)."""
    n = len(series)
    return [_median(series[i * n // 10: (i + 1) * n // 10]) for i in range(10)] if n >= 10 else []


async def soak(*, visits: int, holder_kib: int, workdir: Path, entries: Entries,
               on_progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the study; ``on_progress(total RSS, visits done, visits expected)`` follows it; ``entries``: the
    caller's programs (the local holder agent)."""
    rounds = math.ceil(visits / HOLDERS)
    expected = rounds * HOLDERS
    data = write_holders(workdir / "data", HOLDERS, holder_kib * 1024, seed=7)
    settings = RunSettings(holders=HOLDERS, rounds=rounds, steps_per_visit=1, batch_size=4, seq_len=32, chunk_kib=16,
                           buffer_mib=max(0.0625, 2 * holder_kib / 1024), data_dir=data, out_dir=workdir / "run",
                           transport="local", data_path="direct", model="tiny")
    samples: list[dict[str, int]] = []
    engine_ref: list[TravelEngine] = []
    if on_progress is not None:
        on_progress("", 0, expected)

    def sink(event: ev.Event) -> None:
        if not isinstance(event, ev.VisitCompleted | ev.VisitFailed):
            return
        row = _sample(event.visit, engine_ref[0])
        samples.append(row)
        if on_progress is not None:
            on_progress(f"{mib(row['total']):,.0f} MiB", len(samples), expected)

    t0 = time.perf_counter()
    report, probe, _engine = await run_probed(settings, links=None, entries=entries, sinks=[sink],
                                              on_engine=engine_ref.append)
    total_s = time.perf_counter() - t0
    costs = probe.visit_costs(report)
    d = max(1, len(costs) // 10)
    first, last = [c["overhead"] for c in costs[:d]], [c["overhead"] for c in costs[-d:]]
    first_ms, last_ms = _median(first) * 1e3, _median(last) * 1e3
    mem = {role: growth([s[role] for s in samples]) for role in ROLES}
    for role, g in mem.items():
        g["by_decile_mib"] = [mib(x) for x in _deciles([float(s[role]) for s in samples])]
    deciles = [round(x * 1e3, 2) for x in _deciles([c["overhead"] for c in costs])]
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
