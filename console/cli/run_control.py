"""A run's control channel beyond signals: ``control.jsonl`` in the run folder, one request a line.

``gputravel runs stop/resume/step`` signal the run's process (SIGTERM, SIGUSR1, SIGUSR2); an attached console
(``gputravel-console --attach RUN``) needs more: pause, step, resume, breakpoints by phase and cancel, each as
the console's own keys do them in-process. Any process that may write the run folder appends a request
(``{"action": "pause"}``, ``{"action": "break", "phase": "TRAIN", "on": true}``, ...; an O_APPEND write of
one short line, 0600); the run (``gputravel run``) reads new lines every ``POLL_S`` and hands each to the
engine's ``Control``, so a request lands as a key would: after the current training step, at the next chunk
in PROVISION, or between phases. The file is the run folder's only link between the two processes; it is
also the record of who asked what (each line names its sender and time). Cheap to import."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gputravel.core.runfolder import RunFolder

__all__ = ["ACTIONS", "POLL_S", "ControlInbox", "apply_request", "send_control"]

POLL_S = 0.1
ACTIONS = ("pause", "resume", "step", "break", "cancel")


def send_control(folder: Path, action: str, *, phase: str | None = None, on: bool | None = None,
                 sender: str = "gputravel") -> dict[str, Any]:
    """Append one request to the run's channel; the request as written."""
    if action not in ACTIONS:
        raise ValueError(f"control action {action!r}: one of {', '.join(ACTIONS)}")
    request: dict[str, Any] = {"action": action, "t": time.time(), "sender": sender, "pid": os.getpid()}
    if phase is not None:
        request["phase"] = phase.upper()
    if on is not None:
        request["on"] = on
    fd = os.open(RunFolder(Path(folder)).control, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(request) + "\n").encode())
    finally:
        os.close(fd)
    return request


class ControlInbox:
    """The run's side: the requests appended since the last read (those written before the run started are
    skipped: a channel left by an earlier part of a resumed run asks nothing of this one)."""

    def __init__(self, folder: Path) -> None:
        self.path = RunFolder(Path(folder)).control
        try:
            self.offset = self.path.stat().st_size
        except OSError:
            self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(whole)
        out = []
        for line in whole.splitlines():
            try:
                request = json.loads(line)
            except ValueError:
                continue
            if isinstance(request, dict) and request.get("action") in ACTIONS:
                out.append(request)
        return out


def apply_request(control: Any, request: dict[str, Any]) -> None:
    """One request on the engine's ``Control`` (core/travel/control.py), as the console's key would do it."""
    from gputravel.core.phases import Phase

    action = request["action"]
    if action == "pause":
        control.pause()
    elif action == "resume":
        control.resume()
    elif action == "step":
        control.step()
    elif action == "cancel":
        control.cancel()
    elif action == "break":
        try:
            phase = Phase(str(request.get("phase", "")).upper())
        except ValueError:
            return
        want = request.get("on")
        if want is None or bool(want) != (phase in control.breakpoints):
            control.toggle_breakpoint(phase)
