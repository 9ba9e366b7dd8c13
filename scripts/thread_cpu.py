"""Run a command and account its CPU by thread: which threads of it and of its children (the device service, the
holders' agents) ran, for how long and at which nice value, and how busy the whole machine was meanwhile.

    .venv/bin/python scripts/thread_cpu.py --out threads.json -- .venv/bin/gputravel bench train ... --json

Every ``--every`` seconds it reads ``/proc/<pid>/task/<tid>/stat`` (user + system time, nice) of the command and
its direct children, and ``/proc/stat``'s first line. It prints (and writes to ``--out``) each thread's CPU seconds,
its nice value, how long it was seen alive and its share of a core while alive, largest first, and the machine's
busy cores over the command's life. Linux only. The command's own stdout and stderr pass through.

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
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _threads(pid: int) -> dict[tuple[int, int], tuple[float, int]]:
    """``(pid, tid) -> (CPU seconds, nice)`` of every thread of ``pid``."""
    out: dict[tuple[int, int], tuple[float, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # field 3 (state) first: utime 14, stime 15, nice 19
        out[(pid, int(tid))] = ((int(fields[11]) + int(fields[12])) / TICK, int(fields[16]))
    return out


def _machine() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all cores (``/proc/stat``: idle and iowait are not busy)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


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
    busy0, total0 = _machine()
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        now = time.monotonic() - t0
        for pid in [proc.pid, *_children(proc.pid)]:
            for key, (cpu, nice) in _threads(pid).items():
                rec = seen.setdefault(key, {"pid": key[0], "tid": key[1], "first_s": now, "cpu_s": 0.0})
                rec.update(cpu_s=cpu, nice=nice, last_s=now)
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
              "threads": [r for r in rows if r["cpu_s"] >= 0.05]}
    text = json.dumps(result)
    print(text, file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text)
    return int(proc.returncode or 0)


if __name__ == "__main__":
    raise SystemExit(main())
