"""``gputravel-console --gpus N``: a fleet runs under torchrun (its ranks are separate processes, so no
in-process engine to drive); the console follows all N GPUs live, read-only, by merging the ranks'
recordings (``<out>/rank-R/recording.db``, :mod:`gputravel.console.fleet_view`): N GPUs on the travel route,
one card per device on the GPU screen. ``gputravel-console --replay <out>`` opens the same view on a finished
fleet; ``--replay <out>/rank-R/recording.db`` one GPU's alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import typer

from gputravel.core.config import RunSettings
from gputravel.core.errors import DeviceError, GpuTravelError


def watch_fleet(settings: RunSettings, *, gpus: int, make_app: Any, theme: str,
                wait_s: float = 120.0) -> None:
    """Start the fleet in the background, follow its GPUs until the screen closes, then wait for the fleet."""
    from gputravel.core.fleet.rank import FleetOptions
    from gputravel.core.fleet.run import launch_fleet

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["report"] = launch_fleet(settings, FleetOptions(gpus=gpus), quiet=True)
        except GpuTravelError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="fleet", daemon=True)
    thread.start()
    out = Path(settings.out_dir)
    recording = out / "rank-0" / "recording.db"
    deadline = time.monotonic() + wait_s
    while not recording.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if recording.exists():
        time.sleep(0.5)  # its meta is written with the file (a rank not there yet is picked up when it is)
        make_app(replay=out, theme=theme, readonly=True, follow=True).run()
    typer.echo(f"the fleet of {gpus} GPUs goes on headless until it ends; report: {settings.out_dir}/report.json",
               err=True)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if "report" not in outcome:
        raise DeviceError("the fleet ended without a report")
