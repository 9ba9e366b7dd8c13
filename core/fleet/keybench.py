"""How long the fleet-key agreement takes for W workers (``gputravel bench fleet-key``): W real processes on a
real c10d store on 127.0.0.1, each with the same SIM CVM as a fleet node's, started together once all have
imported torch and connected, timed from that start to the key in hand (the fleet waits for its slowest)."""

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

__all__ = ["bench_key_agreement"]

_WORKER = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
from gputravel.core.fleet.keyagree import FleetCvm, agree_fleet_key
cvm_dir, port, rank, world, job = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cvm = FleetCvm.sim(cvm_dir)
store = dist.PrefixStore(job, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300)))
store.set(f"ready/{rank}", "1")
store.wait(["go"], timedelta(seconds=300))
got = agree_fleet_key(store, rank=rank, world=world, context=job, cvm=cvm, timeout_s=300)
print(json.dumps({"rank": rank, "fingerprint": got.info["key_fingerprint"], "seconds": got.info["seconds"],
                  "verify_s": got.info["verify_s"], "cpu_s": got.info["cpu_s"]}))
"""


def bench_key_agreement(*, workers: int = 8, repeats: int = 3) -> dict[str, Any]:
    """Per repeat: every worker's seconds from the common start to its key, and the fleet's (the slowest)."""
    import torch.distributed as dist

    if workers < 2 or repeats < 1:
        raise ConfigError("bench fleet-key needs --workers >= 2 and --repeats >= 1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="gputravel-fleet-key-") as tmp:
        folder = RunFolder(Path(tmp))
        local_sim_pki(folder)
        master = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                               timeout=timedelta(seconds=300), wait_for_workers=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for repeat in range(repeats):
            job = f"bench-{repeat}"
            procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(folder.cvm), str(master.port), str(r),
                                       str(workers), job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env) for r in range(workers)]
            master.wait([f"{job}/ready/{r}" for r in range(workers)], timedelta(seconds=300))
            started = time.perf_counter()
            master.set(f"{job}/go", "1")
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=300)
                if p.returncode != 0:
                    raise ConfigError(f"a key-agreement worker failed: {err[-400:]}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
            wall = time.perf_counter() - started
            if len({o["fingerprint"] for o in outs}) != 1:
                raise ConfigError("the workers did not agree one fleet key")
            runs.append({"fleet_s": round(max(o["seconds"] for o in outs), 6), "wall_s": round(wall, 6),
                         "worker_s": [o["seconds"] for o in outs], "verify_s": [o["verify_s"] for o in outs],
                         "cpu_s": [o["cpu_s"] for o in outs]})
    fleet_s = [r["fleet_s"] for r in runs]
    cpu_s = [sum(r["cpu_s"]) for r in runs]
    return {"workers": workers, "repeats": repeats, "fleet_ms_median": round(statistics.median(fleet_s) * 1e3, 1),
            "fleet_ms_all": [round(s * 1e3, 1) for s in fleet_s], "cpus": os.cpu_count(), "runs": runs,
            # CPU the W workers spent in the agreement, summed: what a loaded machine cannot inflate
            "cpu_ms_all_workers_median": round(statistics.median(cpu_s) * 1e3, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "note": "SIM CVM quotes (dcap-qvl verification of SIM TDX quotes); all workers on this machine's CPUs"}
