"""How long the fleet-key agreement takes for W workers (``gputravel bench fleet-key``): W real processes on a
real c10d store on 127.0.0.1, each with the same SIM CVM as a fleet node's.

The workers are started once (process start, ``import torch``, the CVM and its collateral: seconds of CPU each,
which on a loaded 2-core machine made the old one-spawn-per-repeat bench run past 300 s) and then agree a fresh key
``1 + repeats`` times, each agreement on its own store prefix and context, all workers released together. An
agreement is timed from the first worker's hello on the store to the last worker's key accepted (CLOCK_MONOTONIC,
one clock for every process of the host): per worker (its key) and for the fleet (the max). The first agreement is
the warm-up (first dcap-qvl call, first store round trips) and is reported apart. The start-up costs are reported
too, apart from the agreement."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from gputravel.core.errors import ConfigError
from gputravel.core.fleet.pki import local_sim_pki
from gputravel.core.runfolder.folder import RunFolder

__all__ = ["bench_key_agreement", "summarise_agreement"]

TIMEOUT_S = 300
_WORKER = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from datetime import timedelta
import torch.distributed as dist
from gputravel.core.fleet.keyagree import FleetCvm, agree_fleet_key
t1, c1 = time.perf_counter(), time.process_time()
cvm_dir, port, rank, world, agreements, timeout, by_family = sys.argv[1], *map(int, sys.argv[2:8])
cvm = FleetCvm.sim(cvm_dir)
start = {"import_s": t1 - t0, "import_cpu_s": c1 - c0, "cvm_s": time.perf_counter() - t1,
         "cvm_cpu_s": time.process_time() - c1}
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
print(json.dumps({"rank": rank, "start": start}), flush=True)
for a in range(agreements):
    store.set(f"a{a}/ready/{rank}", "1")
    store.wait([f"a{a}/go"], timedelta(seconds=timeout))
    got = agree_fleet_key(dist.PrefixStore(f"a{a}", store), rank=rank, world=world, context=f"bench a{a}", cvm=cvm,
                          timeout_s=timeout, by_family=bool(by_family))
    print(json.dumps({"rank": rank, "agreement": a, **{k: got.info[k] for k in (
        "key_fingerprint", "hello_at", "key_at", "cpu_s", "verify_s", "verify_full", "verify_reused")}}), flush=True)
"""


def summarise_agreement(rows: list[dict[str, Any]], go_at: float) -> dict[str, Any]:
    """One agreement's figures from its W workers' rows: ms from the first hello to each worker's key, the fleet's
    (the max), from the release (``go_at``) to the last key, and the CPU and verifications the workers spent.

    Raises:
        ConfigError: the workers did not all agree one key.
    """
    if len({r["key_fingerprint"] for r in rows}) != 1:
        raise ConfigError("bench fleet-key: the workers did not agree one fleet key")
    rows = sorted(rows, key=lambda r: int(r["rank"]))
    first_hello = min(float(r["hello_at"]) for r in rows)
    last_key = max(float(r["key_at"]) for r in rows)
    return {"fleet_ms": round((last_key - first_hello) * 1e3, 2),
            "worker_ms": [round((float(r["key_at"]) - first_hello) * 1e3, 2) for r in rows],
            "release_to_last_key_ms": round((last_key - go_at) * 1e3, 2),
            "cpu_ms": [round(float(r["cpu_s"]) * 1e3, 2) for r in rows],
            "cpu_ms_all_workers": round(sum(float(r["cpu_s"]) for r in rows) * 1e3, 2),
            "verify_full": sum(int(r["verify_full"]) for r in rows),
            "verify_reused": sum(int(r["verify_reused"]) for r in rows)}


def _collect(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise ConfigError(f"a key-agreement worker failed (exit {p.returncode}): {err[-400:]}")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def _await(master: Any, keys: list[str], procs: list[subprocess.Popen[str]]) -> None:
    """Wait for ``keys`` on the store, naming a worker that died meanwhile (no wait on a dead worker's key)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not master.check(keys):  # polled: a timed-out wait would log a c10d warning every second
        dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
        if dead:
            err = dead[0].stderr.read() if dead[0].stderr is not None else ""
            raise ConfigError(f"a key-agreement worker failed (exit {dead[0].returncode}): {err[-400:]}")
        if time.monotonic() > deadline:
            raise ConfigError(f"bench fleet-key: the workers were not ready within {TIMEOUT_S} s")
        time.sleep(0.02)


def bench_key_agreement(*, workers: int = 8, repeats: int = 3, by_family: bool = True) -> dict[str, Any]:
    """``repeats`` timed agreements (after one warm-up) of ``workers`` processes started once; ``by_family`` off:
    every quote checked by dcap-qvl in full (the baseline)."""
    import torch.distributed as dist

    if workers < 2 or repeats < 1:
        raise ConfigError("bench fleet-key needs --workers >= 2 and --repeats >= 1")
    agreements = 1 + repeats
    with tempfile.TemporaryDirectory(prefix="gputravel-fleet-key-") as tmp:
        folder = RunFolder(Path(tmp))
        local_sim_pki(folder)
        master = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                               timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        spawned = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(folder.cvm), str(master.port), str(r),
                                   str(workers), str(agreements), str(TIMEOUT_S), str(int(by_family))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for r in range(workers)]
        try:
            go_at: list[float] = []
            started_s = 0.0
            for a in range(agreements):
                _await(master, [f"a{a}/ready/{r}" for r in range(workers)], procs)
                if a == 0:
                    started_s = time.perf_counter() - spawned
                go_at.append(time.monotonic())
                master.set(f"a{a}/go", "1")
            rows = _collect(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    starts = [r["start"] for r in rows if "start" in r]
    runs = [summarise_agreement([r for r in rows if r.get("agreement") == a], go_at[a]) for a in range(agreements)]
    timed = runs[1:]
    fleet_ms = [r["fleet_ms"] for r in timed]
    return {
        "workers": workers, "repeats": repeats, "cpus": os.cpu_count(), "by_family": by_family,
        "fleet_ms_median": round(statistics.median(fleet_ms), 2), "fleet_ms_all": fleet_ms,
        "fleet_ms_min": min(fleet_ms),
        # CPU the W workers spent in the agreement, summed: what a loaded machine cannot inflate
        "cpu_ms_all_workers_median": round(statistics.median(r["cpu_ms_all_workers"] for r in timed), 2),
        "warmup": runs[0], "runs": timed,
        # once per worker, before any agreement: why a bench that started W processes per repeat took minutes
        "start": {"all_ready_s": round(started_s, 3),
                  "import_cpu_s_median": round(statistics.median(s["import_cpu_s"] for s in starts), 3),
                  "cvm_cpu_s_median": round(statistics.median(s["cvm_cpu_s"] for s in starts), 3)},
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "note": "SIM CVM quotes (dcap-qvl verification of SIM TDX quotes); all workers on this machine's CPUs, "
                + ("one SIM platform (one node): each worker checks one peer's quote in full, the others' by family"
                   if by_family else "every quote checked by dcap-qvl in full (--every-quote-in-full)"),
    }
