"""``gputravel-console --gpus N``: a fleet runs under torchrun (its ranks are separate processes, so no
in-process engine to drive); the console follows all N GPUs live, read-only, by merging the ranks'
recordings (``<out>/rank-R/recording.db``, :mod:`gputravel.console.tui.fleet_view`): N GPUs on the travel route,
one card per device on the GPU screen. ``gputravel-console --replay <out>`` opens the same view on a finished
fleet; ``--replay <out>/rank-R/recording.db`` one GPU's alone.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import typer

from gputravel.core.config import RunSettings
from gputravel.core.errors import DeviceError, GpuTravelError
from gputravel.core.runfolder import RunFolder


def watch_fleet(settings: RunSettings, *, gpus: int, make_app: Any, theme: str) -> None:
    """Start the fleet in the background, follow its GPUs until the screen closes, then wait for the fleet."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        # imported here, in the fleet's thread: it brings torch (seconds), the screen is up meanwhile
        from gputravel.console.entries import launch_gpus
        from gputravel.core.fleet.rank import FleetOptions

        try:
            outcome["report"] = launch_gpus(settings, FleetOptions(gpus=gpus), quiet=True)
        except GpuTravelError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="fleet", daemon=True)
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the screen opens at once (STARTING, the fleet's N GPUs at the orchestrator); each rank's recording is
    # read when it appears, as a follow picks up any rank that starts late
    app = make_app(replay=out, theme=theme, readonly=True, follow=True, gpus=gpus)

    def tell_the_screen() -> None:
        thread.join()
        if "error" in outcome and app.is_running:
            app.call_from_thread(app.notify, f"the fleet failed: {outcome['error']}", severity="error",
                                 timeout=30, markup=False)

    started = threading.Event()

    def start_fleet() -> None:
        if not started.is_set():
            started.set()
            thread.start()
            threading.Thread(target=tell_the_screen, name="fleet-watch", daemon=True).start()

    if hasattr(app, "when_ready"):  # once the first screen is drawn: torchrun's start (and torch's import in
        app.when_ready = start_fleet  # this process) would hold the screen back otherwise
    else:
        start_fleet()
    app.run()
    start_fleet()  # a screen closed before it was drawn: the fleet still runs, headless
    typer.echo(f"the fleet of {gpus} GPUs goes on headless until it ends; report: {RunFolder(settings.out_dir).report}",
               err=True)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if "report" not in outcome:
        raise DeviceError("the fleet ended without a report")
