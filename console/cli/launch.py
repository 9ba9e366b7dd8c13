"""How ``gputravel-console`` starts a run: as its own headless ``gputravel run`` process (issue 35.1).

The console composes nothing itself: ``r`` and ``space`` start ``gputravel run`` with the console's options
and a run folder of their own, in a session of its own (``start_new_session``: closing the console's terminal
or SSH session sends it no SIGHUP), then attach to that folder as ``gputravel-console --attach`` does. The run
folder is the only link: the run's recording is what the console shows, its ``control.jsonl`` what the
console's keys write. The run's stdout and stderr go to an unnamed temporary file (never a pipe, which would
break when the console leaves): the console reads its tail where the run ends before writing its recording.
Imports no Textual."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gputravel.core.runfolder import RunFolder

__all__ = ["LaunchedRun", "Launcher", "next_out_dir"]


@dataclass
class LaunchedRun:
    """A ``gputravel run`` this console started: its folder, its recording, its process, its output."""

    folder: Path
    recording: Path
    proc: subprocess.Popen[bytes]
    output: IO[bytes]
    argv: tuple[str, ...]

    def exit_code(self) -> int | None:
        """The process's exit status once it ended (reaped), else None."""
        return self.proc.poll()

    def output_tail(self, limit: int = 2000) -> str:
        """The end of what the run printed (its error line where it refused its input)."""
        size = os.fstat(self.output.fileno()).st_size
        start = max(0, size - limit)
        data = os.pread(self.output.fileno(), size - start, start)
        return data.decode(errors="replace").strip()


def next_out_dir(out: Path, n: int) -> Path:
    """The folder of the ``n``-th run (1-based) of one console started with ``--out OUT``: OUT itself, then
    OUT-2, OUT-3, ... beside it (a run folder holds one run)."""
    if n <= 1:
        return out
    candidate = out.with_name(f"{out.name}-{n}")
    while RunFolder(candidate).ledger.exists():
        n += 1
        candidate = out.with_name(f"{out.name}-{n}")
    return candidate


@dataclass(frozen=True)
class Launcher:
    """``gputravel run`` with the console's options (``run_args``); ``out``: the console's ``--out`` (its n-th
    run goes to ``next_out_dir(out, n)``), else a new ``runs/run-<time>`` each; ``record``: ``--record FILE``."""

    run_args: tuple[str, ...]
    out: Path | None = None
    record: Path | None = None
    python: str = sys.executable
    started: list[LaunchedRun] = field(default_factory=list, compare=False)

    def target(self) -> Path:
        from gputravel.console.cli.run_options import resolve_out_dir

        n = len(self.started) + 1
        target = next_out_dir(self.out, n) if self.out is not None else resolve_out_dir(None, resume=False,
                                                                                         create=False)
        return target.absolute()

    def argv(self, folder: Path, *, breakpoints: Iterable[str] = (), start_paused: bool = False) -> list[str]:
        argv = [self.python, "-m", "gputravel.console.cli", "run", *self.run_args, "--out", str(folder)]
        if self.record is not None:
            argv += ["--record", str(self.record.absolute())]
        for phase in sorted(breakpoints):
            argv += ["--break-before", phase]
        if start_paused:
            argv.append("--start-paused")
        return argv

    def start(self, *, breakpoints: Iterable[str] = (), start_paused: bool = False) -> LaunchedRun:
        folder = self.target()
        argv = self.argv(folder, breakpoints=breakpoints, start_paused=start_paused)
        output = tempfile.TemporaryFile()  # unnamed: gone once both processes closed it
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                start_new_session=True, env={**os.environ, "COLUMNS": "200"})
        recording = self.record.absolute() if self.record is not None else RunFolder(folder).recording
        run = LaunchedRun(folder=folder, recording=recording, proc=proc, output=output, argv=tuple(argv))
        self.started.append(run)
        return run

    @property
    def last(self) -> LaunchedRun | None:
        return self.started[-1] if self.started else None
