"""``gputravel bench fleet``: how a fleet of N travelling GPUs scales, and what the sealed ring costs it.

For each GPU count N and each gradient all-reduce (the sealed ring ``secure_pipelined`` and ``plain``
``dist.all_reduce``), one whole fleet run under torchrun on the same job:

* data: ``holders`` holders (default 4, so N = 1, 2, 4 all fill their steps), each a .txt of ``holder_kib``
  KiB of printable pseudo-random text in a temporary folder, one part per visit;
* training: the ``tiny`` GPT preset, batch ``batch_size`` x ``seq_len`` byte tokens, ``steps_per_visit``
  optimizer steps per lock-step step, one round, one torch thread per device, local agents.

Reported per run: ``tokens_per_s`` (tokens trained by all GPUs / the lock-step training wall time, the
all-reduce included), ``run_tokens_per_s`` (the same over the whole run, visits and set-up included),
``allreduce_share`` (seconds in the gradient all-reduce / training seconds, averaged over the GPUs) and
``efficiency`` (``tokens_per_s(N) / (N x tokens_per_s(1))`` of the same variant). ``sealed_vs_plain`` gives,
per N, the sealed ring's all-reduce seconds and training throughput over plain's. On a machine with fewer
cores than N ranks need, efficiency measures contention, not the ring.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gputravel.core.bench.data import make_holders
from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.fleet.rank import FLEET_VARIANTS, FleetOptions
from gputravel.core.machine import machine_info

__all__ = ["DEFAULT_VARIANTS", "Launch", "row_from_report", "study"]

DEFAULT_VARIANTS = ("secure_pipelined", "plain")

#: one fleet run: ``launch(settings, fleet) -> report`` (``core.fleet.run.launch_fleet`` with the caller's rank
#: entry, quiet)
Launch = Callable[[RunSettings, FleetOptions], dict[str, Any]]


def row_from_report(report: dict[str, Any], *, gpus: int, variant: str) -> dict[str, Any]:
    """One row of the study from a fleet run's report."""
    fleet = report["fleet"]
    devices = fleet["devices"]
    shares = [d["allreduce_s"] / d["train_s"] for d in devices if d["train_s"] > 0]
    run_s = float(report["seconds"])
    return {"gpus": gpus, "variant": variant, "status": "ok", "steps": fleet["steps"], "tokens": fleet["tokens"],
            "train_s": fleet["train_s"], "tokens_per_s": fleet["tokens_per_s"], "run_s": run_s,
            "run_tokens_per_s": round(fleet["tokens"] / run_s, 1) if run_s else None,
            "allreduce_calls": fleet["allreduce"]["calls"], "allreduce_s": fleet["allreduce"]["seconds"],
            "allreduce_share": round(sum(shares) / len(shares), 4) if shares else None,
            "sealed": fleet["allreduce"]["sealed"], "replica_digests_equal": fleet["replica_digests_equal"]}


def study(gpus: Sequence[int], *, workdir: Path, variants: Sequence[str] = DEFAULT_VARIANTS, holders: int = 4,
          holder_kib: int = 96, steps_per_visit: int = 4, batch_size: int = 8, seq_len: int = 64,
          model: str = "tiny", repeats: int = 1, launch: Launch,
          on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the fleet for every (N, variant), ``repeats`` times (the run with the median tokens/s is the row),
    and return the JSON-able result."""
    if repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    if not gpus or any(n < 1 for n in gpus):
        raise ConfigError("--gpus needs positive GPU counts")
    known = {v.value for v in FLEET_VARIANTS}
    for v in variants:
        if v not in known:
            raise ConfigError(f"variant {v!r} is not one of {', '.join(sorted(known))}")
    data = make_holders(workdir / "data", holders, holder_kib * 1024)
    buffer_mib = max(0.0625, holder_kib * 1.5 / 1024)  # one part per holder
    rows: list[dict[str, Any]] = []
    runs = [(n, v, k) for k in range(repeats) for n in gpus for v in variants]  # repeats interleaved
    t0 = time.perf_counter()
    measured: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for i, (n, variant, k) in enumerate(runs):
        if on_progress:
            on_progress(f"{n} GPU(s) · {variant}" + (f" · {k + 1}/{repeats}" if repeats > 1 else ""), i, len(runs))
        out = workdir / f"run-{n}-{variant}-{k}"
        settings = RunSettings(holders=holders, rounds=1, steps_per_visit=steps_per_visit, buffer_mib=buffer_mib,
                               data_dir=data, out_dir=out, batch_size=batch_size, seq_len=seq_len, model=model,
                               chunk_kib=64, torch_threads=1, transport="local")
        try:
            report = launch(settings, FleetOptions(gpus=n, variant=variant))
            row = row_from_report(report, gpus=n, variant=variant)
        except GpuTravelError as exc:
            row = {"gpus": n, "variant": variant, "status": "failed", "reason": str(exc)}
        measured.setdefault((n, variant), []).append(row)
        shutil.rmtree(out, ignore_errors=True)
    for n in gpus:
        for variant in variants:
            tries = measured[(n, variant)]
            ok = sorted((r for r in tries if r["status"] == "ok"), key=lambda r: r["tokens_per_s"] or 0.0)
            row = ok[len(ok) // 2] if ok else tries[0]
            rows.append({**row, "repeats": len(tries), "tokens_per_s_all": [r.get("tokens_per_s") for r in tries]})
    if on_progress:
        on_progress("done", len(runs), len(runs))
    _efficiency(rows)
    return {"benchmark": "fleet", "machine": machine_info(),
            "job": {"holders": holders, "holder_kib": holder_kib, "steps_per_visit": steps_per_visit, "repeats": repeats,
                    "batch_size": batch_size, "seq_len": seq_len, "model": model, "rounds": 1,
                    "transport": "local", "torch_threads_per_device": 1},
            "rows": rows, "sealed_vs_plain": _sealed_vs_plain(rows), "seconds": round(time.perf_counter() - t0, 2)}


def _efficiency(rows: list[dict[str, Any]]) -> None:
    """Against one GPU: with one GPU every variant is the same job (no all-reduce), so the baseline is the
    fastest one-GPU row (the least disturbed by whatever else runs on the machine)."""
    ones = [r["tokens_per_s"] for r in rows if r["status"] == "ok" and r["gpus"] == 1 and r["tokens_per_s"]]
    one = max(ones) if ones else None
    for r in rows:
        r["efficiency"] = (round(r["tokens_per_s"] / (r["gpus"] * one), 4)
                           if r["status"] == "ok" and one and r["tokens_per_s"] else None)


def _sealed_vs_plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = {(r["gpus"], r["variant"]): r for r in rows if r["status"] == "ok"}
    out = []
    for (n, variant), r in sorted(ok.items()):
        plain = ok.get((n, "plain"))
        if variant == "plain" or plain is None or n == 1:
            continue
        out.append({"gpus": n, "variant": variant,
                    "allreduce_s_over_plain": round(r["allreduce_s"] / plain["allreduce_s"], 2)
                    if plain["allreduce_s"] else None,
                    "tokens_per_s_plain_over_sealed": round(plain["tokens_per_s"] / r["tokens_per_s"], 3)
                    if r["tokens_per_s"] else None,
                    "allreduce_share": r["allreduce_share"], "allreduce_share_plain": plain["allreduce_share"]})
    return out
