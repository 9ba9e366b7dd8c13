"""``bench load``'s study: many holders at once through the loopback SSH server.

N holder accounts on an SSH server; every agent is deployed (connect, upload, verify the bundle hash,
start) in parallel by the engine's set-up; then the visits run one after another on the one (emulated)
GPU with a tiny model, one training step per visit and a few KiB of data per holder, so what is left is
the protocol's own cost. Reported:

* deploy: wall time from the first holder's connect to the last holder's HELLO (all in parallel);
* protocol overhead per visit: ATTEST + HANDOFF + RETURN + VERIFY + SCRUB + the key update of ROTATE
  (the visit records' ``phase_s``; the sealed checkpoint that ROTATE also writes is timed on its own
  by the engine's probe hook and subtracted), i.e. everything but PROVISION and TRAIN;
* the checkpoint time, and the ledger/event bookkeeping between phases, separately;
* peak memory: resident set of the orchestrator, the device service, the SSH server and the agents
  (every process under this one, sampled from /proc).

The SSH server and its links come from the caller (``HolderServer``): core knows nothing of SSH; the
programs' names (to tell the agents' processes apart) come with the caller's ``Entries``.
Helpers here (data, the probed run) are shared with ``bench soak``; /proc sampling is ``core/bench/procmem.py``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from gputravel.core import events as ev
from gputravel.core.bench.procmem import MemorySampler, mib, open_fds
from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.errors import ConfigError
from gputravel.core.machine import machine_info
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.holders import HolderLink, HolderState
from gputravel.core.travel.probes import Timings

#: Phases whose time is the protocol's own cost (PROVISION and TRAIN are the work itself).
PROTOCOL_PHASES = ("ATTEST", "HANDOFF", "RETURN", "VERIFY", "SCRUB", "ROTATE")
OVERHEAD_TARGET_MS = 50.0
DEPLOY_TARGET_S = 10.0
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls sing softly at night in the "
          "old town by the river").split()


# --- data ----------------------------------------------------------------------------------------
def write_holders(root: Path, n: int, nbytes: int, *, seed: int = 0) -> Path:
    """``n`` holder folders ``h00``.. under ``root``, each one .txt file of about ``nbytes`` words."""
    for i in range(n):
        folder = root / f"h{i:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed * 1000 + i)
        words: list[str] = []
        size = 0
        while size < nbytes:
            w = rng.choice(_WORDS)
            words.append(w)
            size += len(w) + 1
        (folder / "data.txt").write_text(" ".join(words)[:nbytes])
    return root


# --- the engine, probed ----------------------------------------------------------------------------
class LoadProbe(Timings):
    """The engine's timings (its probe hook), read as per-visit costs."""

    def visit_costs(self, report: dict[str, Any]) -> list[dict[str, float]]:
        """Per completed visit: protocol overhead, checkpoint, bookkeeping, provisioning and training (s)."""
        out = []
        for v in report["visits"]:
            if not str(v["outcome"]).startswith("done") or not v["phase_s"]:
                continue
            ph = v["phase_s"]
            ckpt = self.checkpoint_s.get(v["visit"] + 1, 0.0)
            per_phase = {p: ph.get(p, 0.0) for p in PROTOCOL_PHASES}
            per_phase["ROTATE"] = max(0.0, per_phase["ROTATE"] - ckpt)  # the key update alone
            wall = self.visit_wall_s.get(v["visit"], sum(ph.values()))
            out.append({"visit": v["visit"], "overhead": sum(per_phase.values()), "checkpoint": ckpt,
                        "provision": ph.get("PROVISION", 0.0), "train": ph.get("TRAIN", 0.0),
                        "bookkeeping": max(0.0, wall - sum(ph.values())), "wall": wall,
                        **{f"phase:{p}": s for p, s in per_phase.items()}})
        return out


def stats_ms(values: Iterable[float]) -> dict[str, float | None]:
    xs = sorted(values)
    if not xs:
        return {"median": None, "mean": None, "p95": None, "max": None}
    return {"median": round(statistics.median(xs) * 1e3, 2), "mean": round(statistics.fmean(xs) * 1e3, 2),
            "p95": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1e3, 2), "max": round(xs[-1] * 1e3, 2)}


def cost_summary(costs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "protocol_overhead_ms": stats_ms(c["overhead"] for c in costs),
        "overhead_by_phase_median_ms": {
            p.lower() if p != "ROTATE" else "rotate_key_update": stats_ms(c[f"phase:{p}"] for c in costs)["median"]
            for p in PROTOCOL_PHASES},
        "checkpoint_ms": stats_ms(c["checkpoint"] for c in costs),
        "bookkeeping_ms": stats_ms(c["bookkeeping"] for c in costs),
        "provision_ms": stats_ms(c["provision"] for c in costs),
        "train_ms": stats_ms(c["train"] for c in costs),
        "visit_wall_ms": stats_ms(c["wall"] for c in costs),
    }


async def run_probed(settings: RunSettings, *, links: list[HolderLink] | None, entries: Entries | None = None,
                     sinks: Iterable[Callable[[ev.Event], None]] = (),
                     on_engine: Callable[[TravelEngine], None] | None = None
                     ) -> tuple[dict[str, Any], LoadProbe, TravelEngine]:
    """The composed run (``core.compose.run``) with a ``LoadProbe`` on the engine's probe hook:
    (report, probe, engine)."""
    from gputravel.core import compose

    probe = LoadProbe()
    built: list[TravelEngine] = []

    def seen(engine: TravelEngine) -> None:
        built.append(engine)
        if on_engine is not None:
            on_engine(engine)

    report = await compose.run(settings, links=links, entries=entries, sinks=sinks, probes=[probe], on_engine=seen)
    return report.to_json(), probe, built[0]


class HolderServer(Protocol):
    """Holders reached over SSH, started by the caller (the console wires the embedded SSH server)."""

    def start(self) -> list[HolderLink]:
        """Start the server (blocking); the links to its holders."""
        ...

    def stop(self) -> None: ...


class HolderServerFactory(Protocol):
    """(holders as (name, data folder), a private work folder or None for a temporary one) -> their server;
    ``data_route`` is how its holders reach the device's TCP data port (the inventory's ``data_route``:
    "forward" through their SSH connection, "network" straight to it)."""

    def __call__(self, holders: list[tuple[str, Path]], workdir: Path | None, /, *,
                 data_route: str = "forward") -> HolderServer: ...


# --- bench load ------------------------------------------------------------------------------------
async def load(*, holders: int, rounds: int, holder_kib: int, steps_per_visit: int, workdir: Path,
               server: HolderServerFactory, entries: Entries = Entries(),
               on_deployed: Callable[[], None] | None = None,
               on_visit: Callable[[], None] | None = None, transport: str = "ssh") -> dict[str, Any]:
    """Run the study; ``on_deployed`` / ``on_visit`` tick once per holder ready and per visit ended;
    ``entries``: the caller's programs (their processes' roles in the memory figures, the local agent's entry).
    ``transport``: "ssh" (the holders behind ``server``'s loopback SSH server) or "local" (agent subprocesses)."""
    if transport not in ("ssh", "local"):
        raise ConfigError("transport is ssh or local")
    data = write_holders(workdir / "data", holders, holder_kib * 1024)
    names = sorted(p.name for p in data.iterdir())
    settings = RunSettings(holders=holders, rounds=rounds, steps_per_visit=steps_per_visit, batch_size=4, seq_len=32,
                           chunk_kib=16, buffer_mib=max(0.0625, 2 * holder_kib / 1024), data_dir=data,
                           out_dir=workdir / "run", transport=transport, data_path="direct", model="tiny")

    def sink(event: ev.Event) -> None:
        if isinstance(event, ev.HolderStateChanged) and event.state == HolderState.READY:
            if on_deployed is not None:
                on_deployed()
        elif isinstance(event, ev.VisitCompleted | ev.VisitFailed):
            if on_visit is not None:
                on_visit()

    ssh = server([(n, data / n) for n in names], _private(workdir / "ssh")) if transport == "ssh" else None
    fds_before = open_fds()
    t0 = time.perf_counter()
    server_s = 0.0
    with MemorySampler(0.1, roles=dict(entries.process_roles)) as mem:
        try:
            t_srv = time.perf_counter()
            links: list[HolderLink] | None = None
            if ssh is not None:
                links = await asyncio.to_thread(ssh.start)
                server_s = time.perf_counter() - t_srv
            report, probe, _engine = await run_probed(settings, links=links, entries=entries, sinks=[sink])
        finally:
            if ssh is not None:
                ssh.stop()
        mem.sample()
    total_s = time.perf_counter() - t0
    costs = probe.visit_costs(report)
    deploy_wall = probe.deploy_wall_s()
    per_holder = [h.get("deploy_s") for h in report["holders"] if h.get("deploy_s") is not None]
    summary = cost_summary(costs)
    overhead_med = summary["protocol_overhead_ms"]["median"]
    # issue 34 item 4: what the orchestrator adds to a visit (the protocol's phases but PROVISION and TRAIN, ROTATE
    # without its checkpoint, which runs in the background, and the bookkeeping between phases), its memory and its
    # descriptors
    orch = [c["overhead"] + c["bookkeeping"] for c in costs]
    row = {"holders": holders, "visits": len(report["visits"]),
           "orchestrator_ms_per_visit": stats_ms(orch)["median"],
           "rss_mb": round(mem.peak.get("orchestrator", 0) / 1e6, 1),
           "open_fds": mem.peak_fds, "open_fds_before": fds_before,
           "agents_rss_mb": round(mem.peak.get("agents", 0) / 1e6, 1),
           "total_rss_mb": round(mem.peak.get("total", 0) / 1e6, 1)}
    return {
        "benchmark": "load",
        "machine": machine_info(),
        "rows": [row],
        "settings": {"holders": holders, "rounds": rounds, "visits": len(report["visits"]),
                     "steps_per_visit": steps_per_visit, "holder_kib": holder_kib, "model": settings.model,
                     "transport": "ssh (embedded loopback server)" if ssh is not None else "local (agent subprocesses)",
                     "data_path": settings.data_path,
                     "buffer_kib": settings.buffer_bytes // 1024, "chunk_kib": settings.chunk_kib},
        "deploy": {"wall_s": round(deploy_wall, 3) if deploy_wall is not None else None,
                   "per_holder_s": {"median": round(statistics.median(per_holder), 3) if per_holder else None,
                                    "max": round(max(per_holder), 3) if per_holder else None},
                   "uploaded": sum(1 for h in report["holders"] if h.get("uploaded")),
                   "ssh_server_start_s": round(server_s, 3), "target_s": DEPLOY_TARGET_S,
                   "within_target": deploy_wall is not None and deploy_wall <= DEPLOY_TARGET_S},
        "per_visit": {**summary, "target_overhead_ms": OVERHEAD_TARGET_MS,
                      "within_target": overhead_med is not None and overhead_med <= OVERHEAD_TARGET_MS,
                      "overhead_includes": "ATTEST (stats, attest, measure) + HANDOFF + RETURN (close window) + "
                                           "VERIFY (measure) + SCRUB + ROTATE minus the sealed checkpoint",
                      "bookkeeping_includes": "ledger rows and events between phases (outside phase_s)"},
        "memory": {"peak_mib": {k: mib(v) for k, v in sorted(mem.peak.items())}, "samples": mem.samples,
                   "note": "resident set sizes from /proc, summed per role (shared pages count once per process); "
                           "other: short-lived deploy helpers on the holders (bundle hash and cryptography checks)"},
        "outcomes": {"done": sum(1 for v in report["visits"] if v["outcome"] == "done"),
                     "failed": report["failed_visits"]},
        "holder_attestation": holder_attestation_cost(report),
        "ledger": {k: report["ledger"][k] for k in ("verified", "rows")},  # verified by the engine's report
        "seconds": round(total_s, 2),
    }


#: issue 22: a holder's own checks (CVM quote, GPU report under its nonce) cost at most this a visit
HOLDER_ATTESTATION_TARGET_MS = 20.0


def holder_attestation_cost(report: dict[str, Any]) -> dict[str, Any]:
    """The holders' own attestation time per visit, as each agent measured it (``visits[].holder_attestation.ms``):
    an agent's first visit checks the chain and the quote's collateral too, its later ones the report alone."""
    seen: set[str] = set()
    first: list[float] = []
    later: list[float] = []
    for v in report["visits"]:
        att = v.get("holder_attestation")
        if not att or att.get("ms") is None:
            continue
        (later if v["holder"] in seen else first).append(float(att["ms"]))
        seen.add(v["holder"])
    every = first + later

    def ms(xs: list[float]) -> dict[str, float | None]:
        return {"median": round(statistics.median(xs), 3) if xs else None, "max": round(max(xs), 3) if xs else None}

    return {"visits": len(every), "all_ms": ms(every), "first_visit_ms": ms(first), "later_visits_ms": ms(later),
            "target_ms": HOLDER_ATTESTATION_TARGET_MS,
            "within_target": bool(every) and max(every) <= HOLDER_ATTESTATION_TARGET_MS,
            "includes": "in the agent: TDX quote + collateral (dcap-qvl, once an agent) and report-data binding; "
                        "SPDM chain (once an agent), report parse, nonce, signature, 64 measurements vs golden"}


def growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How the orchestrator's figures grow from the fewest holders to the most (``bench load``'s rows):
    per-visit time as a ratio, memory and descriptors per added holder."""
    if len(rows) < 2:
        return {}
    a, b = min(rows, key=lambda r: r["holders"]), max(rows, key=lambda r: r["holders"])
    added = b["holders"] - a["holders"]
    ms_a, ms_b = a["orchestrator_ms_per_visit"], b["orchestrator_ms_per_visit"]
    return {"from_holders": a["holders"], "to_holders": b["holders"],
            "orchestrator_ms_per_visit_ratio": round(ms_b / ms_a, 3) if ms_a and ms_b else None,
            "rss_mb_per_added_holder": round((b["rss_mb"] - a["rss_mb"]) / added, 3) if added else None,
            "open_fds_per_added_holder": round((b["open_fds"] - a["open_fds"]) / added, 3) if added else None,
            "targets": {"orchestrator_ms_per_visit_ratio": "<= 1.2", "rss_mb_per_added_holder": "<= 2"}}


def _private(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
