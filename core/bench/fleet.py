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

With ``nnodes`` (issue 36) the same N GPUs also run as a fleet over H "nodes" on this machine: H torchrun
invocations with ``--nnodes H``, each with its own ``--out`` (nothing shared: the SIM PKI is exported once and
installed by each, the fleet key is agreed by attestation over the c10d store on 127.0.0.1), rank 0's node's
report giving the row. ``nodes_vs_one`` gives, per (N, variant), tokens/s over H nodes / tokens/s on one node.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gputravel.core.bench.data import make_holders
from gputravel.core.config import RunSettings
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.fleet.rank import FLEET_VARIANTS, FleetOptions
from gputravel.core.machine import machine_info

__all__ = ["DEFAULT_VARIANTS", "Launch", "row_from_report", "study"]

DEFAULT_VARIANTS = ("secure_pipelined", "plain")

#: one fleet run: ``launch(settings, fleet, rdzv=Rendezvous(...)) -> report`` (``core.fleet.run.launch_fleet``
#: with the caller's rank entry, quiet)
Launch = Callable[..., dict[str, Any]]


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
          model: str = "tiny", repeats: int = 1, launch: Launch, nnodes: Sequence[int] = (1,),
          on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the fleet for every (N, variant, H nodes), ``repeats`` times (the run with the median tokens/s is the
    row), and return the JSON-able result. One node is always measured (the baseline of ``nodes_vs_one``); H > 1
    runs only the GPU counts H divides."""
    if repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    if not gpus or any(n < 1 for n in gpus):
        raise ConfigError("--gpus needs positive GPU counts")
    known = {v.value for v in FLEET_VARIANTS}
    for v in variants:
        if v not in known:
            raise ConfigError(f"variant {v!r} is not one of {', '.join(sorted(known))}")
    if any(h < 1 for h in nnodes):
        raise ConfigError("--nnodes needs positive node counts")
    hosts = sorted({1, *nnodes})
    data = make_holders(workdir / "data", holders, holder_kib * 1024)
    buffer_mib = max(0.0625, holder_kib * 1.5 / 1024)  # one part per holder
    rows: list[dict[str, Any]] = []
    runs = [(n, v, h, k) for k in range(repeats) for n in gpus for v in variants for h in hosts
            if n % h == 0]  # repeats interleaved
    t0 = time.perf_counter()
    measured: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for i, (n, variant, h, k) in enumerate(runs):
        if on_progress:
            on_progress(f"{n} GPU(s) · {variant}" + (f" · {h} nodes" if h > 1 else "")
                        + (f" · {k + 1}/{repeats}" if repeats > 1 else ""), i, len(runs))
        out = workdir / f"run-{n}-{variant}-{h}-{k}"
        settings = RunSettings(holders=holders, rounds=1, steps_per_visit=steps_per_visit, buffer_mib=buffer_mib,
                               data_dir=data, out_dir=out, batch_size=batch_size, seq_len=seq_len, model=model,
                               chunk_kib=64, torch_threads=1, transport="local")
        try:
            report = (launch(settings, FleetOptions(gpus=n, variant=variant)) if h == 1
                      else _on_nodes(launch, settings, FleetOptions(gpus=n, variant=variant), h, workdir))
            row = {**row_from_report(report, gpus=n, variant=variant), "nnodes": h}
        except GpuTravelError as exc:
            row = {"gpus": n, "variant": variant, "nnodes": h, "status": "failed", "reason": str(exc)}
        measured.setdefault((n, variant, h), []).append(row)
        shutil.rmtree(out, ignore_errors=True)
    for n in gpus:
        for variant in variants:
            for h in hosts:
                tries = measured.get((n, variant, h), [])
                if not tries:
                    continue
                ok = sorted((r for r in tries if r["status"] == "ok"), key=lambda r: r["tokens_per_s"] or 0.0)
                row = ok[len(ok) // 2] if ok else tries[0]
                rows.append({**row, "repeats": len(tries),
                             "tokens_per_s_all": [r.get("tokens_per_s") for r in tries]})
    if on_progress:
        on_progress("done", len(runs), len(runs))
    _efficiency(rows)
    return {"benchmark": "fleet", "machine": machine_info(),
            "job": {"holders": holders, "holder_kib": holder_kib, "steps_per_visit": steps_per_visit, "repeats": repeats,
                    "batch_size": batch_size, "seq_len": seq_len, "model": model, "rounds": 1,
                    "transport": "local", "torch_threads_per_device": 1},
            "rows": rows, "sealed_vs_plain": _sealed_vs_plain([r for r in rows if r["nnodes"] == 1]),
            "nodes_vs_one": _nodes_vs_one(rows), "seconds": round(time.perf_counter() - t0, 2)}


def _on_nodes(launch: Launch, settings: RunSettings, fleet: FleetOptions, nnodes: int,
              workdir: Path) -> dict[str, Any]:
    """One fleet over ``nnodes`` local nodes sharing no folder: a torchrun each (``--nnodes``, rendezvous on
    127.0.0.1), each its own ``--out`` (``<out>/node-I``), the SIM PKI exported once; rank 0's node's report."""
    from gputravel.core.fleet.pki import export_sim_pki
    from gputravel.core.fleet.run import Rendezvous

    pki = workdir / "sim-pki.json"
    if not pki.exists():
        export_sim_pki(pki)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    rdzv = Rendezvous(nnodes=nnodes, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"bench-{uuid.uuid4().hex[:8]}",
                      sim_pki=pki)
    results: list[dict[str, Any] | GpuTravelError] = [GpuTravelError("the node never ran")] * nnodes

    def node(i: int) -> None:
        out = settings.out_dir / f"node-{i}"
        out.mkdir(parents=True, mode=0o700)
        try:
            results[i] = launch(replace(settings, out_dir=out), fleet, rdzv=rdzv)
        except GpuTravelError as exc:
            results[i] = exc

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, GpuTravelError):
            raise r
    merged = [r for r in results if isinstance(r, dict) and not r.get("merged_elsewhere")]
    if not merged:
        raise GpuTravelError(f"no node of the {nnodes} returned the fleet's report")
    return merged[0]


def _nodes_vs_one(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (N, variant, H > 1): tokens/s over H nodes / tokens/s of the same N GPUs on one node."""
    ok = {(r["gpus"], r["variant"], r["nnodes"]): r for r in rows if r["status"] == "ok"}
    out = []
    for (n, variant, h), r in sorted(ok.items()):
        one = ok.get((n, variant, 1))
        if h == 1 or one is None:
            continue
        out.append({"gpus": n, "variant": variant, "nnodes": h, "tokens_per_s": r["tokens_per_s"],
                    "tokens_per_s_one_node": one["tokens_per_s"],
                    "tokens_per_s_ratio": round(r["tokens_per_s"] / one["tokens_per_s"], 3)
                    if r["tokens_per_s"] and one["tokens_per_s"] else None})
    return out


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
