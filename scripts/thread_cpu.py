"""Run a command and account its CPU by thread: which threads of it and of its children (the device service, the
holders' agents) ran, for how long and at which nice value, and how busy the whole machine was meanwhile.

    .venv/bin/python scripts/thread_cpu.py --out threads.json -- .venv/bin/gputravel bench train ... --json

Every ``--every`` seconds it reads ``/proc/<pid>/task/<tid>/stat`` (user + system time, nice, minor page faults) of
the command and every process below it (of every thread, with the name it gave the kernel), their resident set (``VmRSS``,
``RssAnon`` of ``/proc/<pid>/status``), and ``/proc/stat``'s first line. It prints (and writes to ``--out``) each
thread's name, CPU seconds, minor page faults, nice value, how long it was seen alive and its share of a core while
alive, largest first; the CPU summed by thread name (``by_name``: a pool's workers together); each process's resident set
over time (``rss``: its peak, its last sample and one sample every ``--every`` seconds, MiB); and the machine's
busy cores over the command's life. Linux only. The command's own stdout and stderr pass through.

The allocator study of issue 32 (docs/models.md) read the device's resident set over a run, and each training
thread's CPU and page faults, with ``GPUTRAVEL_KEEP_FREED_MEMORY`` 1 and 0.

Issue 32's study used it to rule the background checkpoint in or out as the cause of the device's slow steps: the
seal threads (nice +5) show as short-lived threads of the device, the orchestrator's drain as a thread of the
command itself (docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a thread's ``children`` file lists the processes that thread
    forked: the device service is started from a worker thread of the orchestrator, not its main thread)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out.extend(int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return out


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it: the device services, the SSH servers and the holders' agents those
    start (grandchildren of the command)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo.extend(_children(p))
    return out


def _threads(pid: int) -> dict[tuple[int, int], tuple[float, int, int]]:
    """``(pid, tid) -> (CPU seconds, nice, minor page faults)`` of every thread of ``pid``."""
    out: dict[tuple[int, int], tuple[float, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # field 3 (state) first: minflt 10, utime 14, stime 15, nice 19
        out[(pid, int(tid))] = ((int(fields[11]) + int(fields[12])) / TICK, int(fields[16]), int(fields[7]))
    return out


def _thread_name(pid: int, tid: int) -> str:
    """The kernel's name of a thread (``comm``): gputravel's threads give it theirs (``core.procs.name_os_thread``:
    ``device-control``, ``checkpoint-seal``, ``ring-crypto_0`` ...); the main thread and an unnamed one show the
    process's name."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _memory(pid: int) -> tuple[float, float] | None:
    """``(VmRSS, RssAnon)`` of ``pid`` in MiB, None when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.startswith(("VmRSS:", "RssAnon:"))}
    return (kib["VmRSS"] / 1024, kib["RssAnon"] / 1024) if "VmRSS" in kib and "RssAnon" in kib else None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _machine() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all cores (``/proc/stat``: idle and iowait are not busy)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def _by_name(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU seconds summed by process and thread name, a pool's workers together (``ring-crypto_0``, ``_1`` ...
    count as ``ring-crypto``), largest first."""
    sums: dict[tuple[int, str], float] = {}
    for r in rows:
        name = str(r.get("name", ""))
        base = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        sums[(r["pid"], base)] = sums.get((r["pid"], base), 0.0) + float(r["cpu_s"])
    return [{"pid": pid, "name": name, "cpu_s": round(cpu, 2)}
            for (pid, name), cpu in sorted(sums.items(), key=lambda kv: -kv[1]) if cpu >= 0.05]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between looks")
    parser.add_argument("--out", type=Path, default=None, help="write the accounting as JSON here too")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    procs: dict[int, dict[str, Any]] = {}
    busy0, total0 = _machine()
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        now = time.monotonic() - t0
        for pid in _descendants(proc.pid):
            for key, (cpu, nice, minflt) in _threads(pid).items():
                rec = seen.setdefault(key, {"pid": key[0], "tid": key[1], "name": "", "first_s": now,
                                            "cpu_s": 0.0})
                rec.update(cpu_s=cpu, nice=nice, minflt=minflt, last_s=now)
                name = _thread_name(*key)  # read at every look: a thread names itself after it starts
                if name:
                    rec["name"] = ("main:" if key[0] == key[1] else "") + name
            mem = _memory(pid)
            if mem is not None:
                p = procs.setdefault(pid, {"pid": pid, "cmdline": _cmdline(pid)[:200], "peak_mib": 0.0,
                                           "peak_anon_mib": 0.0, "series": []})
                p["cmdline"] = _cmdline(pid)[:200] or p["cmdline"]  # after exec: the program's own
                p["peak_mib"] = round(max(p["peak_mib"], mem[0]), 1)
                p["peak_anon_mib"] = round(max(p["peak_anon_mib"], mem[1]), 1)
                p.update(last_mib=round(mem[0], 1), last_anon_mib=round(mem[1], 1))
                p["series"].append([round(now, 1), round(mem[0], 1)])
        if proc.poll() is not None:
            break
        time.sleep(args.every)
    busy1, total1 = _machine()
    wall = time.monotonic() - t0
    cores = os.cpu_count() or 1
    rows = sorted(seen.values(), key=lambda r: -r["cpu_s"])
    for r in rows:
        alive = max(r["last_s"] - r["first_s"], args.every)
        r.update(alive_s=round(alive, 1), cpu_s=round(r["cpu_s"], 2), core_share=round(r["cpu_s"] / alive, 2),
                 first_s=round(r["first_s"], 1), last_s=round(r["last_s"], 1))
    result = {"command": command, "rc": proc.returncode, "wall_s": round(wall, 2),
              "machine_busy_cores": round(cores * (busy1 - busy0) / max(1, total1 - total0), 2),
              "threads": [r for r in rows if r["cpu_s"] >= 0.05], "by_name": _by_name(rows),
              "rss": sorted(procs.values(), key=lambda p: -p["peak_mib"])}
    text = json.dumps(result)
    print(text, file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text)
    return int(proc.returncode or 0)


if __name__ == "__main__":
    raise SystemExit(main())
