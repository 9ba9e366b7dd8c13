"""How fast an attached console sees a run and steers it (issue 35.1 numbers), printed as JSON.

Starts a real headless ``gputravel run`` (the demo's tiny model on the embedded corpus, local agents, long
visits so that TRAIN lasts), waits until it trains, then, in a real console under Textual's Pilot (headless):

- ``attach_s``: from ``make_app(attach=RUN)`` to the console showing the run's current state (TRAIN, as the
  run's recording has it), ``--repeats`` fresh consoles, each attaching to the running run;
- ``pause_lands_s``: ``p`` in TRAIN, from the request on the run's channel (its time in ``control.jsonl``) to
  the run's own ``RunPaused`` event (its time in the recording): the control landing in the run;
- ``pause_seen_s``: from the key to the console showing the run paused (adds the console's half-second read);
- ``resume_lands_s``: ``p`` again, request to the run's ``RunResumed``.

Goals (issue 35): attach <= 1 s, a control in TRAIN lands <= 1 s. Run from the repository root:

    .venv/bin/python scripts/console_attach_bench.py [--repeats 5] [--out attach.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gputravel.console.tui.app import make_app
from gputravel.console.tui.attach_bridge import AttachedBridge
from gputravel.core.errors import GpuTravelError
from gputravel.core.recording import load_recording
from gputravel.core.runfolder import RunFolder


def start_run(folder: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gputravel.console.cli", "run", "--transport", "local", "--rounds", "1",
         "--steps-per-visit", "100000", "--out", str(folder), "--telemetry-interval", "0.5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=folder.parent)


def recorded(folder: Path) -> list[Any]:
    try:
        return list(load_recording(RunFolder(folder).recording).items)
    except GpuTravelError:
        return []


def wait_training(folder: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(i.name == "TrainingProgressed" for i in recorded(folder)):
            return
        time.sleep(0.2)
    raise SystemExit("the run did not reach TRAIN")


def last_control_t(folder: Path, action: str) -> float:
    lines = [json.loads(line) for line in RunFolder(folder).control.read_text().splitlines()]
    return float([r for r in lines if r["action"] == action][-1]["t"])


def event_after(folder: Path, name: str, t: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [i.t for i in recorded(folder) if i.name == name and i.t >= t]
        if found:
            return found[0]
        time.sleep(0.02)
    raise SystemExit(f"no {name} after the request")


async def until(pilot: Any, cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        await pilot.pause(0.01)


async def once(folder: Path, attach: list[float], lands: list[float], seen: list[float],
               resumed: list[float]) -> None:
    """One fresh console: attach, pause in TRAIN, resume."""
    t0 = time.monotonic()
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(120, 40)) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, AttachedBridge)
        await until(pilot, lambda: bridge.state.current_phase == "TRAIN")
        attach.append(time.monotonic() - t0)
        await pilot.press("p")
        asked = time.monotonic()
        await until(pilot, lambda: bridge.end_state.status == "paused")
        seen.append(time.monotonic() - asked)
        request_t = last_control_t(folder, "pause")
        lands.append(event_after(folder, "RunPaused", request_t) - request_t)
        await pilot.press("p")
        request_t = last_control_t(folder, "resume")
        resumed.append(event_after(folder, "RunResumed", request_t) - request_t)
        await until(pilot, lambda: bridge.end_state.status != "paused")


async def measure(folder: Path, repeats: int) -> dict[str, Any]:
    attach: list[float] = []
    lands: list[float] = []
    seen: list[float] = []
    resumed: list[float] = []
    for _ in range(repeats):
        await once(folder, attach, lands, seen, resumed)

    def row(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}

    return {"repeats": repeats, "attach_s": row(attach), "pause_lands_s": row(lands), "pause_seen_s": row(seen),
            "resume_lands_s": row(resumed),
            "goal_s": 1.0, "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "model": "tiny (the demo's)", "data": "the embedded corpus, 3 holders, local agents"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gputravel-attach-") as tmp:
        folder = Path(tmp) / "run"
        proc = start_run(folder)
        try:
            wait_training(folder)
            result = asyncio.run(measure(folder, args.repeats))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
