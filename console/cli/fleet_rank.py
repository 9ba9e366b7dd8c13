"""One torchrun rank of ``gputravel run --gpus N``: ``python -m gputravel.console.cli.fleet_rank --config FILE``.

torchrun starts N of these (see docs/fleet.md; the module is ``console.entries.GPU_RANK``); each composes its
holders' links like ``gputravel run`` (the embedded loopback SSH server, an inventory, or local agents) and
awaits :func:`gputravel.core.fleet.run.run_rank`, which composes the rank's run (``core.compose``). Progress goes to stderr, one line per fact, prefixed by the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import signal
import sys
from pathlib import Path

from gputravel.core import events as ev
from gputravel.core.errors import GpuTravelError
from gputravel.core.fleet.lifeline import end_with_launcher


class _Lines:
    """Progress as plain lines on stderr (torchrun interleaves the ranks' output)."""

    def __init__(self, rank: int) -> None:
        self.tag = f"[gpu {rank}]"

    def __call__(self, event: ev.Event) -> None:
        line = None
        if isinstance(event, ev.DeviceAttested):
            line = f"attested {event.device_id} {'ok' if event.ok else 'FAILED'}"
        elif isinstance(event, ev.TrainingStepped):
            line = f"visit {event.visit + 1} {event.holder}: loss {event.losses[0]:.3f} -> {event.losses[-1]:.3f}"
        elif isinstance(event, ev.VisitFailed):
            line = f"visit {event.visit + 1} {event.holder} failed in {event.phase}: {event.error}"
        elif isinstance(event, ev.RunCompleted):
            line = f"done: {event.visits} visits, {event.failed} failed, {event.seconds:.1f} s"
        if line:  # one write: print's text and newline are two, and two ranks' lines could merge between them
            sys.stderr.write(f"{self.tag} {line}\n")
            sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    # first, before the imports that take seconds (torch): this worker dies with torchrun, torchrun with the
    # launcher, so a launcher killed outright leaves no worker, device service or agent behind (lifeline.py)
    untied = end_with_launcher()
    if untied is not None:
        sys.stderr.write(f"[gpu {os.environ.get('RANK', '?')}] note: {untied}\n")
    from gputravel.console.entries import ENTRIES
    from gputravel.console.holders import HolderSet
    from gputravel.core.fleet.node import my_fleet_rank
    from gputravel.core.fleet.run import load_config, run_rank
    from gputravel.core.recording import Recorder
    from gputravel.core.runfolder import RunFolder

    parser = argparse.ArgumentParser(prog="python -m gputravel.console.cli.fleet_rank")
    parser.add_argument("--config", required=True, type=Path, help="<out>/fleet.json, written by gputravel run")
    ns = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a hung rank is, on its stderr
    rank = int(os.environ.get("RANK", "0"))
    try:
        settings, fleet = load_config(ns.config)
        rank = my_fleet_rank(RunFolder(settings.out_dir))  # the rank folder this node holds (a resumed node)
        holders = HolderSet(settings)
        # each GPU's events and telemetry, for `gputravel-console --replay <out>/rank-R/recording.db`
        mine = RunFolder(settings.out_dir).rank(rank)
        mine.path.mkdir(parents=True, exist_ok=True)
        recorder = Recorder(mine.recording, meta={"source": "gputravel run --gpus", "gpu": rank, "gpus": fleet.gpus,
                                                  "ledger": str(mine.ledger)})
        try:
            links = holders.links()
            # and its device's telemetry, sampled once a second into the same recording
            asyncio.run(run_rank(settings, fleet, links=links, entries=ENTRIES, sinks=[_Lines(rank), recorder],
                                 telemetry=recorder.record_telemetry))
        finally:
            recorder.close()
            holders.close()
    except GpuTravelError as exc:
        print(f"[gpu {os.environ.get('RANK', '?')}] {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
