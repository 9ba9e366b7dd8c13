"""Running a fleet: the torchrun command line (launcher side) and one rank's run (worker side).

``launch_fleet`` writes ``<out>/fleet.json`` and runs torchrun's elastic launcher
(``python -m torch.distributed.run``, c10d rendezvous) over ``entry``, the caller's rank module (whose
``main`` reads that file and awaits :func:`run_rank`; core never names it: ``Entries.gpu_rank``). Rank 0 merges the ranks' reports into ``<out>/report.json`` and keeps
the fleet ledger ``<out>/ledger.db``, which records every rank ledger's head. torchrun's output is shown live
unless quiet and its tail kept either way (``tee.py``); a failed job is named from the ranks' reports and that
tail (``failure.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.errors import ConfigError, FleetDeviceLostError, GpuTravelError
from gputravel.core.events import Event
from gputravel.core.fleet.failure import RankError, job_failure, read_report
from gputravel.core.fleet.lifeline import LAUNCHER_PID_ENV
from gputravel.core.fleet.node import join_fleet
from gputravel.core.fleet.pki import install_sim_pki, local_sim_pki
from gputravel.core.fleet.platform import FleetPlatform
from gputravel.core.fleet.rank import FleetGroup, FleetOptions, FleetRank, fleet_engine
from gputravel.core.fleet.tee import run_teed
from gputravel.core.fleet.verify import verify_fleet
from gputravel.core.ledger import Ledger, verify_ledger
from gputravel.core.runfolder.folder import RunFolder
from gputravel.core.telemetry.model import TelemetryFrame
from gputravel.core.telemetry.recorded import TELEMETRY_INTERVAL_S, rank_sampler
from gputravel.core.travel.engine import TravelEngine
from gputravel.core.travel.holders import HolderLink
from gputravel.core.travel.report import RunReport

__all__ = ["Rendezvous", "launch_fleet", "load_config", "merge_reports", "run_rank", "torchrun_command",
           "verify_fleet"]


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """torchrun's own options, passed through (single host by default)."""

    nnodes: int = 1
    rdzv_endpoint: str | None = None  # default: 127.0.0.1 and a free port
    rdzv_id: str | None = None
    max_restarts: int = 0
    #: SIM: the emulated vendors' PKI file every node installs (``gputravel fleet pki export``); needed for nnodes > 1
    sim_pki: Path | None = None

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.max_restarts < 0:
            raise ConfigError("--nnodes must be >= 1 and --max-restarts >= 0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(config: Path, *, gpus: int, rdzv: Rendezvous, entry: str) -> list[str]:
    """The torchrun command line of a fleet of ``gpus`` ranks over ``rdzv.nnodes`` hosts."""
    if gpus % rdzv.nnodes:
        raise ConfigError(f"--gpus {gpus} does not split evenly over --nnodes {rdzv.nnodes}")
    endpoint = rdzv.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(rdzv.nnodes),
           "--nproc-per-node", str(gpus // rdzv.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--max-restarts", str(rdzv.max_restarts)]
    # a job id of its own: a job that lands on a port another job's store holds never mixes with it
    cmd += ["--rdzv-id", rdzv.rdzv_id or f"gputravel-{uuid.uuid4().hex[:12]}"]
    return [*cmd, "-m", entry, "--config", str(config)]


def load_config(path: Path) -> tuple[RunSettings, FleetOptions]:
    try:
        data = json.loads(Path(path).read_text())
        return RunSettings.from_dict(data["settings"]), FleetOptions.from_dict(data["fleet"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"fleet config {path}: {exc}") from None


def launch_fleet(settings: RunSettings, fleet: FleetOptions, *, entry: str, rdzv: Rendezvous = Rendezvous(),
                 env: dict[str, str] | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the fleet under torchrun (``entry``: the module each rank runs) and return rank 0's merged report;
    a failed job raises the ranks' typed error (each rank leaves ``<out>/rank-R/report.json`` with its error)."""
    if not entry:
        raise ConfigError("a fleet needs the module each rank runs (Entries.gpu_rank)")
    if settings.cvm_kind != "tdx":  # before anything is written or started
        raise ConfigError(f"--cvm-kind {settings.cvm_kind} is refused for a fleet (--gpus, --nnodes): its workers "
                          "agree the fleet key by SIM TDX quotes only (the SIM SNP chip is made per node and "
                          "--sim-pki carries no SNP PKI); run the fleet with --cvm-kind tdx")
    folder = RunFolder(settings.out_dir)
    out = folder.path
    out.mkdir(parents=True, exist_ok=True)
    # SIM: the vendors' PKI this node trusts (its devices are certified under it, its CVM quotes under it)
    if rdzv.sim_pki is not None:
        install_sim_pki(rdzv.sim_pki, folder)
    elif rdzv.nnodes > 1:
        raise ConfigError(f"a fleet over --nnodes {rdzv.nnodes} hosts needs --sim-pki FILE (the emulated vendors' "
                          "PKI every node trusts: gputravel fleet pki export FILE, then carry it to each node)")
    else:
        local_sim_pki(folder)
    config = folder.fleet_config
    if not settings.resume or not config.exists():
        config.write_text(json.dumps({"settings": settings.to_dict(), "fleet": fleet.to_dict()}, indent=2) + "\n")
    else:  # --resume continues the fleet as it was configured (its settings, its GPU count)
        saved = json.loads(config.read_text())
        saved["settings"].update(resume=True, fault=settings.fault)
        saved["fleet"]["ring_fault"] = fleet.ring_fault  # a fault is for the attempt it was given to, as fault is
        config.write_text(json.dumps(saved, indent=2) + "\n")
        fleet = FleetOptions.from_dict(saved["fleet"])
    report_path = folder.report
    for stale in [report_path, *(rank.report for _, rank in folder.ranks())]:  # an earlier attempt's: never this one's
        stale.unlink(missing_ok=True)
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env[LAUNCHER_PID_ENV] = str(os.getpid())  # what each worker checks (lifeline.py)
    # torchrun's output (the ranks' progress, its own account) shown live on our stderr unless quiet (stdout stays
    # the report's); its tail kept either way, for the job's error
    shown = None if quiet else sys.stderr
    for attempt in (1, 2):
        started = time.time()
        cmd = torchrun_command(config, gpus=fleet.gpus, rdzv=rdzv, entry=entry)
        proc = run_teed(cmd, env=child_env, show=shown)
        touched = [r.ledger for _, r in folder.ranks() if r.ledger.exists() and r.ledger.stat().st_mtime >= started - 1]
        # The rendezvous itself failed (no rank got as far as its ledger; e.g. the free port was taken in
        # between): once more on a fresh port, when the endpoint was ours to choose.
        said = any(r.report.exists() for _, r in folder.ranks())  # a rank's own word (a refusal)
        if proc.returncode == 0 or touched or said or rdzv.rdzv_endpoint is not None or attempt == 2:
            break
    if report_path.exists():
        merged = read_report(report_path)
        if merged.error is not None:
            raise merged.error.to_error()
        return merged.data
    errors: list[RankError] = []
    local: list[dict[str, Any]] = []
    silent: list[int] = []  # ranks of this host that left no report
    for n, rank in folder.ranks():
        if not rank.report.exists():
            silent.append(n)
            continue
        read = read_report(rank.report)
        local.append(read.data)
        if read.error is not None:
            errors.append(read.error)
    if errors or proc.returncode != 0 or not local:
        raise job_failure(proc.returncode, proc.text, errors=errors, silent=silent)
    # a host without rank 0: its ranks' own reports
    return {"merged_elsewhere": True, "note": "rank 0 runs on another host and writes the fleet's report",
            "ranks": [r.get("gpu") for r in local], "failed_visits": sum(r.get("failed_visits", 0) for r in local)}


async def run_rank(settings: RunSettings, fleet: FleetOptions, *, links: Iterable[HolderLink] | None = None,
                   entries: Entries | None = None, sinks: Iterable[Callable[[Event], None]] = (),
                   telemetry: Callable[[TelemetryFrame], None] | None = None,
                   telemetry_interval: float = TELEMETRY_INTERVAL_S) -> dict[str, Any] | None:
    """This torchrun rank's part: start its device, run its share, exchange reports; rank 0 returns the
    merged report (and writes it and the fleet ledger). ``telemetry``: where this rank's device's telemetry
    frames go (its recording), one every ``telemetry_interval`` seconds while the rank runs, and a last one
    with the final counters before the device stops."""
    import torch

    from gputravel.core import compose

    folder = RunFolder(settings.out_dir)
    out = folder.path
    # the fleet key: agreed by the workers' attested CVMs over the store, held in memory only
    try:
        agreed = await asyncio.to_thread(join_fleet, folder, timeout_s=fleet.timeout_s,
                                         join_timeout_s=fleet.join_timeout_s,
                                         inject=settings.holder_inject)
    except GpuTravelError as exc:  # refused (a worker's quote) or no agreement: this rank's word, then stop
        me = folder.rank(int(os.environ.get("RANK", "0")))
        me.path.mkdir(parents=True, exist_ok=True)
        me.report.write_text(json.dumps({"error": {"code": exc.code, "reason": exc.reason},
                                         "gpu": {"rank": int(os.environ.get("RANK", "0"))}}, indent=2) + "\n")
        raise
    group = FleetGroup(key=agreed.key, timeout_s=fleet.timeout_s, rank=agreed.rank, attempt=agreed.attempt)
    rank = folder.rank(group.rank)
    rank_dir = rank.path
    resume = settings.resume or (group.restart > 0 and rank.ledger.exists())
    device = settings.device
    if device is None and torch.cuda.is_available():
        device = f"cuda:{group.local_rank}"  # one GPU per rank
    # a fault plan is for the job's first attempt: an elastic restart resumes without it
    rsettings = replace(settings, out_dir=rank_dir, device=device, resume=resume,
                        fault=settings.fault if group.restart == 0 else None)
    platform = partial(FleetPlatform, vendor_dir=folder.vendor, device_id=f"emu-gpu-{group.rank}")
    error: GpuTravelError | None = None
    report: RunReport | None = None
    course: FleetRank | None = None  # this rank's part of its engine
    def built(made: TravelEngine) -> None:
        nonlocal course
        assert isinstance(made.course, FleetRank)
        course = made.course

    # this rank's device (and its own CUDA device's NVML), as a single run does, with the final counters
    plan = (compose.RunTelemetryPlan(record=telemetry, interval=telemetry_interval, sampler=rank_sampler(device),
                                     final=True, name=f"fleet-telemetry-{group.rank}")
            if telemetry is not None else None)
    try:
        report = await compose.run(rsettings, links=links, entries=entries, sinks=sinks, on_engine=built,
                                   telemetry=plan, platform_type=platform, engine_type=fleet_engine, fleet=fleet,
                                   group=group)
    except GpuTravelError as exc:
        error = exc
    mine = report.to_json() if report is not None else {
        "error": {"code": error.code if error else "error", "reason": error.reason if error else "?"},
        "gpu": {"rank": group.rank, "device_id": course.device_id if course else None},
        "ledger": {"path": str(rank.ledger)}}
    # this rank's ledger, verified where it lies; its head reaches rank 0 over the authenticated group
    v = verify_ledger(rank.ledger)
    mine["ledger_head"] = {"verified": v.ok, "rows": v.rows, "head": v.head_hash, "reason": v.reason}
    mine["key_agreement"] = agreed.info
    mine["node"] = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank
    rank.report.write_text(json.dumps(mine, indent=2) + "\n")
    if error is not None and not isinstance(error, FleetDeviceLostError):
        raise error  # torchrun's agent stops the other ranks
    reports = await group.agree(mine)
    merged = merge_reports(reports, out=out, fleet=fleet) if group.rank == 0 else None
    # every node gets the fleet's report (rank 0 merged it), and says which ranks are its own
    shared: dict[str, Any] | None = (await group.agree(merged))[0]
    merged = shared
    if group.local_rank == 0 and merged is not None:
        here = [int(r["gpu"]["rank"]) for r in reports if r.get("node") == mine.get("node")]
        node = {"ranks": here, "fleet_ledger": 0 in here,
                "note": None if len(here) == group.world else "the other ranks' folders are on other nodes"}
        folder.report.write_text(json.dumps({**merged, "node": node}, indent=2) + "\n")
    group.close()
    if error is not None:
        raise error
    return merged


def merge_reports(reports: list[dict[str, Any]], *, out: Path, fleet: FleetOptions) -> dict[str, Any]:
    """One fleet report from the ranks' reports; writes the fleet ledger (``<out>/ledger.db``)."""
    failed = [r for r in reports if r.get("error")]
    if failed:  # a device lost for good: every rank stopped with it
        err = failed[0]["error"]
        heads = _write_fleet_ledger(out, reports, None)
        return {"error": err, "fleet": {"gpus": fleet.gpus, "devices": [r.get("gpu") for r in reports]},
                "ledger": heads, "checkpoints": [str(RunFolder(out).rank(i).checkpoints) for i in range(len(reports))]}
    r0 = reports[0]
    visits = sorted((v for r in reports for v in r["visits"]), key=lambda v: (v["step"], v["gpu"]))
    gpus = [r["gpu"] for r in reports]
    steps_log: list[dict[str, Any]] = r0.get("fleet_steps", [])
    trained = [v for v in visits if v["loss_first"] is not None]
    train_wall = max(g["train_s"] for g in gpus) or 0.0
    tokens = sum(g["tokens"] for g in gpus)
    plan = r0.get("fleet_plan", {})
    fleet_obj = {
        "gpus": fleet.gpus, "rounds": plan.get("rounds"), "steps": plan.get("steps"), "schedule": plan.get("table"),
        "idle_slots": plan.get("idle_slots"), "backend": gpus[0]["join"].get("backend"),
        "allreduce": {"variant": fleet.variant, "calls": sum(g["allreduce_calls"] for g in gpus),
                      "seconds": round(sum(g["allreduce_s"] for g in gpus), 6),
                      "calls_per_gpu": [g["allreduce_calls"] for g in gpus],
                      "seconds_per_gpu": [g["allreduce_s"] for g in gpus],
                      "sealed": bool(gpus[0]["join"].get("sealed"))},
        "replica_digests_equal": bool(steps_log) and all(s["digests_equal"] for s in steps_log),
        "final_model_digest": steps_log[-1]["digest"] if steps_log else r0["training"]["model_digest"],
        "nodes": sorted({int(r.get("node", 0)) for r in reports}),
        "key_agreement": r0.get("key_agreement"),
        "step_log": steps_log,
        "tokens": tokens, "train_s": round(train_wall, 6),
        "tokens_per_s": round(tokens / train_wall, 1) if train_wall else None,
        "devices": [{**g, "attestation": r["attestation"], "node": r.get("node", 0)}
                    for g, r in zip(gpus, reports, strict=True)],
    }
    prov_bytes = sum(r["provisioning"]["bytes"] for r in reports)
    prov_s = sum(r["provisioning"]["seconds"] for r in reports)
    report = {
        "run_id": r0["run_id"], "platform": r0["platform"],
        "attestation": {"ok": all(r["attestation"]["ok"] for r in reports),
                        "device_id": [r["attestation"]["device_id"] for r in reports]},
        "holders": r0["holders"], "visits": visits,
        "training": {**r0["training"],
                     "loss_first": trained[0]["loss_first"] if trained else None,
                     "loss_last": trained[-1]["loss_last"] if trained else None,
                     "tokens_per_s": fleet_obj["tokens_per_s"],
                     "model_digest": steps_log[-1]["digest"] if steps_log else r0["training"]["model_digest"],
                     "loss_curve_by_gpu": [r["training"]["loss_curve"] for r in reports]},
        "provisioning": {**r0["provisioning"], "bytes": prov_bytes, "seconds": round(prov_s, 6),
                         "mb_s": round(prov_bytes / prov_s / 1e6, 2) if prov_s else None},
        "fleet": fleet_obj,
        "checkpoints": {"dirs": [r["checkpoints"]["dir"] for r in reports],
                        "last_seq": [r["checkpoints"]["last_seq"] for r in reports]},
        "failed_visits": sum(r["failed_visits"] for r in reports),
        "retried_visits": sum(r["retried_visits"] for r in reports),
        "attacks": [a for r in reports for a in r["attacks"]],
        "device_restarts": 0, "session_rekeys": sum(r["session_rekeys"] for r in reports),
        "control_rotations": sum(r["control_rotations"] for r in reports),
        "seconds": max(r["seconds"] for r in reports),
    }
    report["ledger"] = _write_fleet_ledger(out, reports, report)
    return report


def _write_fleet_ledger(out: Path, reports: list[dict[str, Any]], report: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's fleet ledger: the devices, every step's weights and digest check, every rank ledger's head;
    then every chain verified."""
    ranks = []
    for i, r in enumerate(reports):  # each rank verified its own ledger on its node and sent its head
        path = str(r.get("ledger", {}).get("path") or RunFolder(out).rank(i).ledger)
        head = r.get("ledger_head") or {}
        ranks.append({"gpu": i, "node": r.get("node", 0), "path": path, "verified": bool(head.get("verified")),
                      "rows": head.get("rows", 0), "head": head.get("head"), "reason": head.get("reason")})
    run_id = str(report["run_id"]) if report else None
    fleet_ledger = RunFolder(out).ledger
    with Ledger.open(fleet_ledger, run_id=run_id) as ledger:
        for r, entry in zip(reports, ranks, strict=True):
            gpu = r.get("gpu") or {}
            ledger.append(kind="fleet-device", outcome="ok" if entry["verified"] else "broken",
                          detail={"gpu": entry["gpu"], "device": gpu.get("device_id"),
                                  "epochs": gpu.get("epochs"), "ledger_head": f"{entry['rows']}:{entry['head']}",
                                  "join": gpu.get("join", {})})
        if report is not None:
            for step in report["fleet"]["step_log"]:
                ledger.append(kind="fleet-step", outcome="ok" if step["digests_equal"] else "diverged",
                              detail={"step": step["step"], "weights": step["weights"], "digest": step["digest"],
                                      "holders": report["fleet"]["schedule"][step["step"]]})
            ledger.append(kind="fleet-completed", outcome="ok" if not report["failed_visits"] else "partial",
                          detail={"gpus": report["fleet"]["gpus"], "allreduce": {
                              k: report["fleet"]["allreduce"][k] for k in ("variant", "calls", "seconds")},
                              "replica_digests_equal": report["fleet"]["replica_digests_equal"]})
        else:
            err = next(r["error"] for r in reports if r.get("error"))
            ledger.append(kind="fleet-stopped", outcome=err["code"], detail={"error": err["reason"]})
    v = verify_ledger(fleet_ledger)
    return {"path": str(fleet_ledger), "verified": v.ok and all(e["verified"] for e in ranks), "rows": v.rows,
            "head": v.head_hash, "reason": v.reason, "fleet_verified": v.ok, "ranks": ranks}
