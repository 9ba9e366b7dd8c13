"""How a run ended, always: the engine's final event, or one the console writes for it; and ``status.json``,
where a run folder says so itself.

The engine ends every run it can with ``RunCompleted`` or ``RunFailed``. Where it cannot (an exception that is
not a :class:`GpuTravelError`, the worker cancelled, the engine never built), the console's run worker and
``gputravel run`` write the ``RunFailed`` themselves, so neither the screen nor a recording is left saying
"running" about a run that is over. A recording's meta gets ``status`` and ``error`` at the end either way.

``status.json`` in the run folder (``core/runfolder/status.py``) is the one place ``gputravel runs`` reads a
run's status from first: a :class:`RunEnding` given the folder writes ``paused`` when the run pauses, removes it
when it goes on, and writes the final status (``completed``, ``partial``, ``failed``, ``cancelled``) when it
ends, with or without a recording; ``gputravel run --gpus N`` writes the fleet's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputravel.console.view.ending import TERMINAL_EVENTS, control_lands, final_status
from gputravel.core import events as ev
from gputravel.core.errors import CancelledRunError, GpuTravelError, StorageError
from gputravel.core.runfolder import FINAL_STATUSES, RunFolder, clear_status, write_status

if TYPE_CHECKING:
    from gputravel.core.recording import Recorder

__all__ = ["FINAL_STATUSES", "TERMINAL_EVENTS", "RunEnding", "control_lands", "ending_code", "final_status",
           "resume_hint"]

def resume_hint(error: KeyboardInterrupt | CancelledRunError | StorageError, folder: Path) -> BaseException:
    """A run cancelled (Ctrl-C, ``gputravel runs stop``, a console's cancel) or stopped by its disk (full, or a
    write refused) whose folder kept its ledger: the error that names how to continue that very run. A plain
    ``gputravel run --resume`` continues ``runs/latest``, which is another run once a second one has started or
    where ``--out`` put this one elsewhere. A run that committed nothing left no folder: ``error`` as it was."""
    if not RunFolder(folder).ledger.exists():
        return error
    resume = f"`gputravel run --resume --out {folder}`"
    if isinstance(error, StorageError):  # its reason says `gputravel run --resume`: name the folder there
        named = type(error)(error.reason.replace("`gputravel run --resume`", resume))
        named.detail = error.detail
        return named
    reason = error.reason if isinstance(error, CancelledRunError) else "cancelled (Ctrl-C)"
    return CancelledRunError(f"{reason}; what was committed is kept: {resume} continues it")


def ending_code(error: BaseException) -> str:
    """The ``code`` a ``RunFailed`` carries for ``error``."""
    if isinstance(error, GpuTravelError):
        return error.code
    if isinstance(error, asyncio.CancelledError | KeyboardInterrupt):
        return "cancelled"
    return "internal"


class RunEnding:
    """An engine sink that watches for the run's final event; :meth:`finish` supplies one if it never came."""

    def __init__(self, out_dir: Path | None = None) -> None:
        self.run_id: str | None = None
        self.final: ev.Event | None = None
        self.out_dir = out_dir  # where status.json goes (None: nowhere)

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.RunStarted | ev.RunCompleted | ev.RunFailed):
            self.run_id = event.run_id
        if event.kind in TERMINAL_EVENTS:
            self.final = event
            self._write(event)
        elif self.out_dir is not None and isinstance(event, ev.RunPaused):
            write_status(self.out_dir, "paused", run_id=self.run_id, t=event.t)
        elif self.out_dir is not None and isinstance(event, ev.RunResumed):
            clear_status(self.out_dir)

    def _write(self, event: ev.Event) -> None:
        if self.out_dir is None:
            return
        error, code = (event.error, event.code) if isinstance(event, ev.RunFailed) else (None, None)
        write_status(self.out_dir, final_status(event), run_id=self.run_id, t=event.t, error=error, code=code)

    @property
    def ended(self) -> bool:
        return self.final is not None

    def finish(self, error: BaseException | None, *, recorder: Recorder | None = None) -> ev.Event | None:
        """After the run: the ``RunFailed`` written on the engine's behalf (None when the engine wrote its
        own final event, or the run ended without error and without one), recorded if there is a recorder;
        the recorder's meta then says how the run ended."""
        made: ev.Event | None = None
        if self.final is None and error is not None:
            text = str(error) or type(error).__name__
            if ending_code(error) == "internal":
                text = f"{type(error).__name__}: {text}"
            made = ev.RunFailed(time.time(), self.run_id or "-", text, ending_code(error))
            self(made)
            if recorder is not None:
                recorder.record_event(made)
        if recorder is not None and self.final is not None:
            meta: dict[str, Any] = {"status": final_status(self.final), "ended_at": self.final.t}
            if isinstance(self.final, ev.RunFailed):
                meta["error"] = self.final.error
            recorder.set_meta(meta)
        return made
