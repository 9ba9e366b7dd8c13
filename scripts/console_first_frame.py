"""Time to the console's first frame in a real terminal: start ``gputravel-console ARGS`` in a detached tmux
session and poll its pane every 10 ms until it shows TEXT (default: the footer's ``Quit``); print the
seconds from the start (wall) and the CPU seconds the console had used by then (user + system: the figure
that does not depend on what else the machine runs) as JSON. The session is killed afterwards (the fleet it
started with it).

    .venv/bin/python scripts/console_first_frame.py [--size 120x40] [--text Quit] [--runs 3] -- --gpus 2

Needs tmux. A figure for a report, not a test: no timed assertion lives in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def cpu_seconds(session: str) -> float | None:
    """User + system CPU seconds of the pane's console process (the pane's shell's child, if any)."""
    pid = subprocess.run(["tmux", "display", "-p", "-t", session, "#{pane_pid}"], capture_output=True,
                         text=True).stdout.strip()
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if Path(f"/proc/{pid}/comm").read_text().strip() in ("sh", "bash", "dash") and children:
            pid = children[0]
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_frame(args: list[str], *, size: str, text: str, timeout: float) -> tuple[float, float | None] | None:
    cols, rows = size.split("x")
    session = f"first-frame-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="first-frame-") as work:
        binary = ROOT / ".venv" / "bin" / "gputravel-console"
        cmd = shlex.join([str(binary), *args, "--out", f"{work}/run"] if "--replay" not in args
                         else [str(binary), *args])
        t0 = time.perf_counter()
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", cols, "-y", rows, "-c", work, cmd],
                       check=True)
        try:
            while time.perf_counter() - t0 < timeout:
                if text in pane(session):
                    return time.perf_counter() - t0, cpu_seconds(session)
                time.sleep(0.01)
            return None
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
            time.sleep(1.0)  # the killed console's fleet winds down before the next start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="120x40")
    ap.add_argument("--text", default="Quit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("console_args", nargs="*")
    ns = ap.parse_args()
    times = [first_frame(ns.console_args, size=ns.size, text=ns.text, timeout=ns.timeout) for _ in range(ns.runs)]
    seen = [t for t in times if t is not None]
    cpu = [c for _, c in seen if c is not None]
    json.dump({"args": ns.console_args, "size": ns.size, "text": ns.text,
               "seconds": [round(t[0], 3) if t is not None else None for t in times],
               "best_s": round(min(w for w, _ in seen), 3) if seen else None,
               "cpu_s": [round(c, 2) for c in cpu], "load_1min": os.getloadavg()[0]}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
