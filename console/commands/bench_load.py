"""``gputravel bench load``: many holders at once through the loopback SSH server.

N holder accounts on the embedded SSH server; every agent is deployed (connect, upload, verify the
bundle hash, start) in parallel by the engine's set-up; then the visits run one after another on the
one (emulated) GPU with a tiny model, one training step per visit and a few KiB of data per holder,
so what is left is the protocol's own cost. Reported:

* deploy: wall time from the first holder's connect to the last holder's HELLO (all in parallel);
* protocol overhead per visit: ATTEST + HANDOFF + RETURN + VERIFY + SCRUB + the key update of ROTATE
  (the visit records' ``phase_s``; the sealed checkpoint that ROTATE also writes is timed on its own
  by wrapping ``engine._checkpoint`` and subtracted), i.e. everything but PROVISION and TRAIN;
* the checkpoint time, and the ledger/event bookkeeping between phases, separately;
* peak memory: resident set of the orchestrator, the device service, the SSH server and the agents
  (every process under this one, sampled from /proc).

Helpers here (data, /proc sampling, the engine probe) are shared with ``bench soak``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputravel.core.machine import machine_info

#: Phases whose time is the protocol's own cost (PROVISION and TRAIN are the work itself).
PROTOCOL_PHASES = ("ATTEST", "HANDOFF", "RETURN", "VERIFY", "SCRUB", "ROTATE")
OVERHEAD_TARGET_MS = 50.0
DEPLOY_TARGET_S = 10.0
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls sing softly at night in the "
          "old town by the river").split()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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


# --- memory --------------------------------------------------------------------------------------
def rss(pid: int | None) -> int:
    """Resident set size of ``pid`` in bytes (0 when it is gone)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def anon_rss(pid: int | None) -> int:
    """The anonymous part of ``pid``'s resident set (heap, stacks; no mapped files or shared libraries) in
    bytes, from ``RssAnon`` in /proc/PID/status (0 when it is gone): what a leak grows."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "orchestrator"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return "other"
    if b"gputravel.core.device" in cmd:
        return "device"
    if b"gputravel.agents.holder" in cmd:
        return "agents"
    if b"gputravel.agents.sshserver" in cmd:
        return "ssh_server"
    return "other"


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def memory_by_role(root: int | None = None) -> dict[str, int]:
    """Resident bytes of this process tree, summed per role (shared pages count once per process)."""
    root = os.getpid() if root is None else root
    by: dict[str, int] = {}
    for pid in process_tree(root):
        role = _role(pid, root)
        by[role] = by.get(role, 0) + rss(pid)
    by["total"] = sum(by.values())
    return by


class MemorySampler:
    """Samples ``memory_by_role`` in a thread; keeps each role's peak and the peak of the total."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mem-sampler")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, int]:
        now = memory_by_role()
        for role, n in now.items():
            self.peak[role] = max(self.peak.get(role, 0), n)
        self.samples += 1
        return now

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def mib(n: float) -> float:
    return round(n / 2**20, 1)


# --- the engine, probed ----------------------------------------------------------------------------
class EngineProbe:
    """Wraps a built engine's ``_checkpoint`` and ``visit`` and the links' ``start`` to time them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.checkpoint_s: dict[int, float] = {}
        self.visit_wall_s: dict[int, float] = {}
        self.start_at: dict[str, tuple[float, float]] = {}
        checkpoint, visit = engine._checkpoint, engine.visit

        async def timed_checkpoint(seq: int, **kw: Any) -> None:
            t0 = time.perf_counter()
            await checkpoint(seq, **kw)
            self.checkpoint_s[seq] = time.perf_counter() - t0

        async def timed_visit(rec: Any) -> None:
            t0 = time.perf_counter()
            try:
                await visit(rec)
            finally:
                self.visit_wall_s[rec.plan.index] = time.perf_counter() - t0

        engine._checkpoint, engine.visit = timed_checkpoint, timed_visit
        for name, link in engine.links.items():
            self._wrap_start(name, link)

    def _wrap_start(self, name: str, link: Any) -> None:
        start = link.start

        async def timed_start() -> Any:
            t0 = time.perf_counter()
            info = await start()
            self.start_at.setdefault(name, (t0, time.perf_counter()))
            return info

        link.start = timed_start

    def deploy_wall_s(self) -> float | None:
        if not self.start_at:
            return None
        return max(e for _, e in self.start_at.values()) - min(s for s, _ in self.start_at.values())

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


async def run_probed(settings: Any, *, links: list[Any] | None, sinks: Iterable[Callable[[Any], None]] = (),
                     on_engine: Callable[[Any], None] | None = None) -> tuple[dict[str, Any], EngineProbe, Any]:
    """``api.run`` with the engine probed: (report, probe, engine)."""
    from gputravel.core import api

    engine = await asyncio.to_thread(api.build_engine, settings, links=links)
    probe = EngineProbe(engine)
    engine.sinks.extend(sinks)
    if on_engine is not None:
        on_engine(engine)
    try:
        report = await engine.run()
    finally:
        await engine.aclose()
    return report, probe, engine


# --- bench load ------------------------------------------------------------------------------------
async def load(*, holders: int, rounds: int, holder_kib: int, steps_per_visit: int, workdir: Path,
               console: Console | None = None) -> dict[str, Any]:
    from gputravel.agents.fleet import EmbeddedSshServer, links_from_specs
    from gputravel.core import events as ev
    from gputravel.core.config import RunSettings

    data = write_holders(workdir / "data", holders, holder_kib * 1024)
    names = sorted(p.name for p in data.iterdir())
    settings = RunSettings(holders=holders, rounds=rounds, steps_per_visit=steps_per_visit, batch_size=4, seq_len=32,
                           chunk_kib=16, buffer_mib=max(0.0625, 2 * holder_kib / 1024), data_dir=data,
                           out_dir=workdir / "run", transport="ssh", data_path="direct", model="tiny")
    progress = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console or Console(stderr=True), transient=True)
    deploy_task = progress.add_task("deploying agents", total=holders)
    visit_task = progress.add_task("visits", total=holders * rounds)

    def sink(event: Any) -> None:
        if isinstance(event, ev.HolderStateChanged) and event.state == "ready":
            progress.advance(deploy_task)
        elif isinstance(event, ev.VisitCompleted | ev.VisitFailed):
            progress.advance(visit_task)

    server = EmbeddedSshServer([(n, data / n) for n in names], workdir=_private(workdir / "ssh"))
    t0 = time.perf_counter()
    with progress, MemorySampler(0.1) as mem:
        try:
            t_srv = time.perf_counter()
            specs = await asyncio.to_thread(server.start)
            server_s = time.perf_counter() - t_srv
            report, probe, engine = await run_probed(settings, links=list(links_from_specs(specs)), sinks=[sink])
        finally:
            server.stop()
        mem.sample()
    total_s = time.perf_counter() - t0
    costs = probe.visit_costs(report)
    deploy_wall = probe.deploy_wall_s()
    per_holder = [h.get("deploy_s") for h in report["holders"] if h.get("deploy_s") is not None]
    summary = cost_summary(costs)
    overhead_med = summary["protocol_overhead_ms"]["median"]
    return {
        "benchmark": "load",
        "machine": machine_info(),
        "settings": {"holders": holders, "rounds": rounds, "visits": len(report["visits"]),
                     "steps_per_visit": steps_per_visit, "holder_kib": holder_kib, "model": settings.model,
                     "transport": "ssh (embedded loopback server)", "data_path": settings.data_path,
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
        "ledger": {k: report["ledger"][k] for k in ("verified", "rows")},  # verified by the engine's report
        "seconds": round(total_s, 2),
    }


def _private(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def render_load(result: dict[str, Any]) -> None:
    s, d, pv, m = result["settings"], result["deploy"], result["per_visit"], result["memory"]
    table = Table(title=f"bench load: {s['holders']} holders × {s['rounds']} rounds over loopback SSH "
                        f"({s['visits']} visits, {result['seconds']:.1f} s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row(f"deploy, {s['holders']} agents in parallel (wall)", f"{d['wall_s']:.2f} s",
                  f"≤ {d['target_s']:.0f} s {'✓' if d['within_target'] else '✗'}")
    table.add_row("protocol overhead / visit (median)", f"{pv['protocol_overhead_ms']['median']:.1f} ms",
                  f"≤ {pv['target_overhead_ms']:.0f} ms {'✓' if pv['within_target'] else '✗'}")
    table.add_row("protocol overhead / visit (p95)", f"{pv['protocol_overhead_ms']['p95']:.1f} ms", "")
    for phase, ms in pv["overhead_by_phase_median_ms"].items():
        table.add_row(f"  {phase}", f"{ms:.2f} ms", "")
    table.add_row("sealed checkpoint / visit (median)", f"{pv['checkpoint_ms']['median']:.1f} ms", "")
    table.add_row("ledger + events / visit (median)", f"{pv['bookkeeping_ms']['median']:.1f} ms", "")
    table.add_row("provision / train (median)", f"{pv['provision_ms']['median']:.1f} / "
                  f"{pv['train_ms']['median']:.1f} ms", "")
    for role, v in m["peak_mib"].items():
        table.add_row(f"peak RSS: {role}", f"{v:,.1f} MiB", "")
    table.add_row("ledger", "verified" if result["ledger"]["verified"] else "BROKEN", "")
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("load")
    def load_cmd(
        holders: int = typer.Option(16, "--holders", min=1, max=64, help="Holder accounts on the loopback SSH server."),
        rounds: int = typer.Option(2, "--rounds", min=1),
        holder_kib: int = typer.Option(12, "--holder-kib", min=1, help="Synthetic text per holder (KiB)."),
        steps_per_visit: int = typer.Option(1, "--steps-per-visit", min=1),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Deploy N agents in parallel over loopback SSH, run their visits; deploy time, per-visit protocol
        overhead, peak memory."""
        console = Console(stderr=True)
        with tempfile.TemporaryDirectory(prefix="gputravel-load-") as tmp:
            result = asyncio.run(load(holders=holders, rounds=rounds, holder_kib=holder_kib,
                                      steps_per_visit=steps_per_visit, workdir=Path(tmp), console=console))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render_load(result)
