"""``gputravel bench travel``: the Travelling-vs-conventional transfer study (the GPU Travelling seed table).

For each buffer size and each path, one whole training run on the same job; reported per run: training
time, transfer time and the transfer share.

The job (stated in the JSON under ``job`` and in docs/provisioning.md):

* data: ``--holders`` holders (default 2), each one .txt file of ``--dataset-mib`` MiB of printable
  pseudo-random text (hex digits from ``os.urandom``), written to a temporary folder; default size
  ``max(8, 1.25 × the largest buffer that runs)`` MiB, so every finite buffer takes at least two visits;
* the training: the ``tiny`` GPT preset (2 layers, 128 wide, byte tokens), batch 8 × 64 tokens, one torch
  thread (a core stays free for the data path), one round over every holder's data (the seed's one pass,
  scaled down): each visit trains ``round(MiB of training data in the visit × --steps-per-mib)`` steps, so the
  total number of steps (the training work) is the same for every buffer size;
* ``uncapped``: one buffer holding a holder's whole data (one visit per holder).

The two paths (the same holders, agents deployed through the embedded loopback SSH server):

* ``travelling``: ``data_path="direct"`` with parallel authentication and overlap: the agent seals each
  chunk once under the GPU's key and sends it straight to the device;
* ``conventional``: ``data_path="conventional"``: plaintext over the holder's SSH link to the orchestrator's
  CVM, which re-encrypts it for the bounce buffer; the device decrypts it. By default without parallel
  authentication and overlap (as a CC driver does it); ``--conventional-fixes`` gives it both.

``train_s`` is the device's training time summed over the visits (including the held-out evaluation),
``tx_s`` the visits' transfer times summed (each from its window's key asked for, the HANDOFF, to the last chunk
in device memory: the time the window is open to the holder, the orchestrator's bookkeeping between the two phases
included), and
``tx_pct = 100 · tx_s / (tx_s + train_s)``; ``tx_pct_of_visits`` divides by all visit phases instead
(attestation, hand-off, scrub, the sealed checkpoint included).

A size the machine cannot hold (3 × the buffer + 1 GiB of memory, above ``--max-mib``, above the engine's
64 GiB limit) is a row with ``status: "skipped"`` and the reason; a run that fails is ``status: "failed"``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, Protocol

from gputravel.core import events as ev
from gputravel.core import planner
from gputravel.core.bench.data import make_holders
from gputravel.core.config import RunSettings
from gputravel.core.entries import Entries
from gputravel.core.errors import ConfigError, GpuTravelError
from gputravel.core.machine import machine_info as core_machine_info
from gputravel.core.travel.report import RunReport

__all__ = ["ProgressFn", "RunFn", "label", "machine_info", "mem_available", "ratios", "row_from_report",
           "skip_reason", "study"]

MIB = 1 << 20
ENGINE_MAX_MIB = 64 * 1024
MEMORY_OVERHEAD = 1 << 30
VAL_FRACTION = 0.1
VAL_SHARE = 0.1


class RunFn(Protocol):
    """One training run with its holders, returning the engine's report (``console.holders.run``)."""

    def __call__(self, settings: RunSettings, *, sinks: Iterable[Callable[[ev.Event], None]]
                 ) -> Coroutine[Any, Any, RunReport]: ...


#: ``on_progress(description, done, total)``: where a study is (visits done of those expected).
ProgressFn = Callable[[str, int, int], None]


def _no_progress(description: str, done: int, total: int) -> None:
    return None


# --- the machine -----------------------------------------------------------------------------------------
def mem_available() -> int:
    """Bytes of memory available for new work (``MemAvailable``; ``os.sysconf`` free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a memory-backed file system (its files then take RAM)."""
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1] if len(parts) >= 3 else ""
                inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
                if mount and inside and len(mount) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs")


def machine_info() -> dict[str, Any]:
    """``core.machine``'s facts plus the memory available now and the load average."""
    info = core_machine_info()
    info["mem_available_mib"] = round(mem_available() / MIB)
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def memory_need(buffer_bytes: int) -> int:
    """What a run with this buffer needs: the device's buffer, the trainer's view of it and the conventional
    path's plaintext window in the orchestrator (3 × the buffer), plus the processes themselves."""
    return 3 * buffer_bytes + MEMORY_OVERHEAD


def skip_reason(buffer_mib: float, *, max_mib: float | None, available: int) -> str | None:
    """Why a buffer of ``buffer_mib`` cannot run here, or None."""
    if max_mib is not None and buffer_mib > max_mib:
        return f"above --max-mib {max_mib:g}"
    if buffer_mib > ENGINE_MAX_MIB:
        return f"above the engine's buffer limit ({ENGINE_MAX_MIB} MiB)"
    need = memory_need(int(buffer_mib * MIB))
    if need > available:
        return (f"needs about {need / 2**30:,.1f} GiB of memory (3 × buffer + 1 GiB); "
                f"{available / 2**30:,.1f} GiB available")
    return None


# --- the job ---------------------------------------------------------------------------------------------
def label(buffer_mib: float | str | None) -> str:
    """A buffer size as the study names it: ``uncapped``, ``4``, ``0.25``."""
    if buffer_mib is None or buffer_mib == "uncapped":
        return "uncapped"
    value = float(buffer_mib)
    return str(int(value)) if value.is_integer() else f"{value:g}"


def provision_rate(*, size: int, chunk: int, workdir: Path, entries: Entries, repeats: int = 3) -> dict[str, Any]:
    """The data phase's rate of ``bench provision``'s direct path on this machine, now (a local agent into the
    device's buffer, the shared-memory ring where the host has one): the median over ``repeats`` hand-offs of
    ``size`` bytes of the agent's first seal to its last acknowledgement. A travel row's bound is its bytes at
    this rate: Tx with no fixed cost at all."""
    from gputravel.core.bench.provision import measure_path

    stages: list[dict[str, float]] = []
    fixed: list[dict[str, float]] = []
    times = asyncio.run(measure_path("direct", size=size, chunk=chunk, repeats=repeats, workdir=workdir, server=None,
                                     entries=entries, stages=stages, fixed=fixed))
    data_s = statistics.median(r["data_s"] for r in stages)
    return {"path": "direct (local agent)", "size_mib": round(size / MIB, 4), "repeats": repeats,
            "data_phase_mb_s": round(size / data_s / 1e6, 1), "hand_off_mb_s": round(size / statistics.median(times) / 1e6, 1),
            "fixed_stages_ms": {k: round(statistics.median(f[k] for f in fixed), 4) for k in fixed[0]}}


def later_visits(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The visits after each holder's first: their agent's data connection is kept (parked at the device) from
    its earlier hand-off, so only these can have their HANDOFF relayed; a holder's first visit opens the connection
    and maps its ring (a round trip and the ring's set-up that the later ones skip)."""
    seen: set[str] = set()
    later = []
    for v in done:
        if v.get("holder") in seen:
            later.append(v)
        seen.add(str(v.get("holder")))
    return later


def fixed_ms(done: list[dict[str, Any]]) -> dict[str, float] | None:
    """The visits' hand-off fixed cost by stage (``visits[].handoff_fixed_ms``), the median of each stage."""
    per = [v["handoff_fixed_ms"] for v in done if v.get("handoff_fixed_ms")]
    if not per:
        return None
    return {k: round(statistics.median(p.get(k, 0.0) for p in per), 4) for k in per[0]}


def with_bound(row: dict[str, Any], rate_b_s: float | None) -> dict[str, Any]:
    """A row's bound (its bytes moved at ``rate_b_s``, the same run's provision data-phase rate) and
    ``fraction_of_bound`` = bound_tx_s / tx_s (1: Tx has no fixed cost)."""
    if rate_b_s is None or row.get("status") != "ok" or not row.get("tx_s"):
        return {**row, "bound_tx_s": None, "fraction_of_bound": None}
    bound = row["bytes"] / rate_b_s
    return {**row, "bound_tx_s": round(bound, 6), "fraction_of_bound": round(bound / row["tx_s"], 4),
            "fixed_tx_s_per_visit": round((row["tx_s"] - bound) / row["visits"], 6) if row["visits"] else None}


def row_from_report(report: dict[str, Any], base: dict[str, Any], wall_s: float) -> dict[str, Any]:
    visits = report["visits"]
    done = [v for v in visits if str(v.get("outcome", "")).startswith("done")]
    tx = sum(float(v["provision_s"]) for v in done)
    train = sum(float(v["train_s"]) for v in done)
    nbytes = sum(int(v["bytes"]) for v in done)
    phases = sum(sum(float(x) for x in v.get("phase_s", {}).values()) for v in done)
    steps = int(report.get("training", {}).get("steps") or 0)
    row = {**base, "status": "ok", "reason": None, "visits": len(done), "bytes": nbytes, "steps": steps,
           "train_s": round(train, 6), "tx_s": round(tx, 6),
           "tx_pct": round(100.0 * tx / (tx + train), 4) if tx + train > 0 else None,
           "tx_pct_of_visits": round(100.0 * tx / phases, 4) if phases > 0 else None,
           "visits_s": round(phases, 6), "protocol_s": round(max(0.0, phases - tx - train), 6),
           "mb_s": round(nbytes / tx / 1e6, 2) if tx > 0 else None,
           "tx_s_per_visit": round(tx / len(done), 6) if done else None,
           "train_s_per_step": round(train / steps, 6) if steps else None,
           "wall_s": round(wall_s, 3), "model_params": report.get("training", {}).get("model_params"),
           "handoff_fixed_ms": fixed_ms(done),
           # the steady state: each holder's first visit left out (it opens the agent's data connection; few visits,
           # as at 20 MiB, let it move every stage's median), and how many hand-offs could be relayed at all
           "handoff_fixed_ms_later": fixed_ms(later_visits(done)),
           "handoffs_relayed": sum(1 for v in done if v.get("handoff_relayed")),
           "handoffs_relayable": len(later_visits(done))}
    failed = int(report.get("failed_visits") or 0)
    if failed or len(done) != len(visits):
        row["status"], row["reason"] = "failed", f"{failed} visit(s) failed"
    return row


def _empty_row(base: dict[str, Any], status: str, reason: str) -> dict[str, Any]:
    return {**base, "status": status, "reason": reason, "visits": None, "bytes": None, "steps": None,
            "train_s": None, "tx_s": None, "tx_pct": None, "tx_pct_of_visits": None, "mb_s": None}


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per buffer size, from the two runs measured in this study: conventional transfer time over Travelling's."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["path"] != "travelling" or r["status"] != "ok":
            continue
        conv = next((c for c in rows if c["buffer_mib"] == r["buffer_mib"] and c["path"] == "conventional"
                     and c["status"] == "ok"), None)
        if conv is None or not r["tx_s"]:
            continue
        out[str(r["buffer_mib"])] = {
            "tx_conventional_over_travelling": round(conv["tx_s"] / r["tx_s"], 2),
            "tx_s_per_visit_conventional_over_travelling":
                round(conv["tx_s_per_visit"] / r["tx_s_per_visit"], 2) if r.get("tx_s_per_visit") else None,
            "tx_pct": {"travelling": r["tx_pct"], "conventional": conv["tx_pct"]}}
    return out


def study(buffers: list[float | None], *, workdir: Path, run: RunFn, dataset_mib: float | None = None,
          holders: int = 2, steps_per_mib: float = 4.0, model: str = "tiny", batch_size: int = 8, seq_len: int = 64,
          chunk_kib: int = 1024, transport: str = "ssh", max_mib: float | None = None, torch_threads: int = 1,
          conventional_fixes: bool = False, paths: tuple[str, ...] = planner.PATHS,
          on_progress: ProgressFn | None = None, entries: Entries | None = None,
          attest_prefetch: bool = True, handoff_relay: bool = False,
          handoff_with_window: bool = True, grant_at_completion: bool = True) -> dict[str, Any]:
    """Run the study; returns the JSON-able result (``benchmark: travel``).

    ``run`` runs one training run with its holders (the console's holder set: the embedded SSH server for
    ``transport="ssh"``); ``on_progress(description, visits done, visits expected)`` follows it. With
    ``entries`` (the local agent's entry), each row's bound is measured in the same run (``provision_rate``)."""
    if holders < 1:
        raise ConfigError("holders must be >= 1")
    if not steps_per_mib > 0:
        raise ConfigError("steps-per-mib must be > 0")
    for p in paths:
        if p not in planner.PATHS:
            raise ConfigError(f"unknown path {p!r}; choose from {', '.join(planner.PATHS)}")
    available = mem_available()
    finite = [b for b in buffers if b is not None]
    reasons: dict[float | None, str | None] = {b: skip_reason(b, max_mib=max_mib, available=available)
                                               for b in finite}
    feasible = [b for b in finite if reasons[b] is None]
    holder_mib = dataset_mib if dataset_mib is not None else max(8.0, 1.25 * max(feasible, default=0.0))
    holder_bytes = int(holder_mib * MIB)
    if holder_bytes < 4096:
        raise ConfigError("dataset-mib must be at least 4 KiB")
    uncapped = planner.uncapped_buffer_bytes([holder_bytes] * holders, val_fraction=VAL_FRACTION,
                                             val_share=VAL_SHARE)
    if None in buffers:
        reasons[None] = skip_reason(uncapped / MIB, max_mib=max_mib, available=available)
    workdir.mkdir(parents=True, exist_ok=True)
    total_data = holder_bytes * holders
    free_disk = shutil.disk_usage(workdir).free
    if total_data + (64 << 20) > free_disk:
        raise ConfigError(f"the dataset ({total_data / MIB:,.0f} MiB) does not fit in {workdir} "
                          f"({free_disk / MIB:,.0f} MiB free); lower --dataset-mib")
    if on_tmpfs(workdir):  # the dataset's files take memory too
        for b, reason in list(reasons.items()):
            need = memory_need(uncapped if b is None else int(b * MIB)) + total_data
            if reason is None and need > available:
                reasons[b] = (f"needs about {need / 2**30:,.1f} GiB of memory (3 × buffer + 1 GiB + the dataset "
                              f"on tmpfs); {available / 2**30:,.1f} GiB available")

    plan: list[tuple[float | None, int, int]] = []  # (requested, buffer bytes, steps per visit)
    for b in buffers:
        size = uncapped if b is None else int(b * MIB)
        shape = planner.schedule([holder_bytes], buffer_bytes=max(size, 1), val_fraction=VAL_FRACTION,
                                 val_share=VAL_SHARE)
        plan.append((b, size, planner.steps_for(shape[0].train_bytes, steps_per_mib)))
    runnable = [(b, size, spv) for b, size, spv in plan if reasons.get(b) is None]
    expected = sum(len(planner.schedule([holder_bytes] * holders, buffer_bytes=size, val_fraction=VAL_FRACTION,
                                        val_share=VAL_SHARE)) for _, size, _ in runnable) * len(paths)

    rows: list[dict[str, Any]] = []
    data = workdir / "data"
    progress = on_progress or _no_progress
    done = 0
    description = "writing the dataset"
    total = max(expected, 1)
    progress(description, done, total)
    t_start = time.perf_counter()
    if runnable:
        make_holders(data, holders, holder_bytes)
    for b, size, spv in plan:
        for path in paths:
            # Travelling: the device's own choice (auto: on where cores are free); conventional: off unless asked
            fixes: bool | None = None if (path == "travelling" or conventional_fixes) else False
            base = {"buffer_mib": "uncapped" if b is None else b, "buffer_bytes": size,
                    "buffer_mib_used": round(size / MIB, 4), "path": path,
                    "data_path": planner.DATA_PATH[path], "parallel_auth": fixes, "overlap": fixes,
                    "steps_per_visit": spv}
            reason = reasons.get(b)
            if reason is not None:
                rows.append(_empty_row(base, "skipped", reason))
                continue
            description = f"{label(b)} MiB · {path}"
            progress(description, done, total)
            settings = RunSettings(
                holders=holders, rounds=1, steps_per_visit=spv, buffer_mib=size / MIB, data_dir=data,
                out_dir=workdir / f"run-{label(b)}-{path}", chunk_kib=chunk_kib, val_fraction=VAL_FRACTION,
                val_share=VAL_SHARE, model=model, batch_size=batch_size, seq_len=seq_len,
                torch_threads=torch_threads, transport=transport, data_path=planner.DATA_PATH[path],
                parallel_auth=fixes, overlap=fixes, attest_prefetch=attest_prefetch,
                handoff_relay=handoff_relay, handoff_with_window=handoff_with_window,
                grant_at_completion=grant_at_completion)

            def sink(event: ev.Event, _description: str = description) -> None:
                nonlocal done
                if isinstance(event, ev.VisitCompleted | ev.VisitFailed):
                    done += 1
                    progress(_description, done, total)

            t0 = time.perf_counter()
            try:
                report = asyncio.run(run(settings, sinks=[sink])).to_json()
            except GpuTravelError as exc:
                rows.append(_empty_row(base, "failed", str(exc)))
                continue
            except (OSError, RuntimeError, ValueError) as exc:
                rows.append(_empty_row(base, "failed", f"{type(exc).__name__}: {exc}"))
                continue
            finally:
                shutil.rmtree(settings.out_dir, ignore_errors=True)
            rows.append(row_from_report(report, base, time.perf_counter() - t0))
    bound: dict[str, Any] | None = None
    if entries is not None and entries.holder_agent and runnable:
        progress("the bound: provision's data phase", done, total)
        size = min(64 * MIB, max(MIB, max(s for _, s, _ in runnable)))
        bound = provision_rate(size=size, chunk=chunk_kib << 10, workdir=workdir / "bound", entries=entries)
    rate = bound["data_phase_mb_s"] * 1e6 if bound else None
    rows = [with_bound(r, rate) for r in rows]
    params = next((r.get("model_params") for r in rows if r.get("model_params")), None)
    job = {"model": model, "model_params": params, "batch_size": batch_size, "seq_len": seq_len,
           "tokens_per_step": batch_size * seq_len, "steps_per_mib": steps_per_mib, "holders": holders,
           "holder_mib": round(holder_mib, 4), "dataset_mib": round(holder_mib * holders, 4),
           "dataset": "one .txt per holder of printable pseudo-random text (hex digits from os.urandom)",
           "rounds": 1, "val_fraction": VAL_FRACTION, "val_share": VAL_SHARE, "torch_threads": torch_threads,
           "chunk_kib": chunk_kib, "transport": transport, "attest_prefetch": attest_prefetch,
           "handoff_relay": handoff_relay, "handoff_with_window": handoff_with_window,
           "grant_at_completion": grant_at_completion, "paths": list(paths),
           "steps_rule": "steps per visit = max(1, round(MiB of training data in the visit × steps_per_mib)); "
                         "one round over all data, so total steps are the same for every buffer size",
           "tx_pct": "100 · tx_s / (tx_s + train_s)"}
    return {"benchmark": "travel", "machine": machine_info(), "job": job,
            "paths": {p: {"data_path": planner.DATA_PATH[p],
                          "parallel_auth": "auto" if p == "travelling" or conventional_fixes else False,
                          "overlap": "auto" if p == "travelling" or conventional_fixes else False} for p in paths},
            "buffers": [label(b) for b in buffers], "rows": rows, "ratios": ratios(rows),
            # each row's bound: its bytes at the data-phase rate of ``bench provision``'s direct path measured
            # after the runs (no fixed cost at all); ``fraction_of_bound`` = bound_tx_s / tx_s
            "bound": bound,
            "seconds": round(time.perf_counter() - t_start, 2)}
