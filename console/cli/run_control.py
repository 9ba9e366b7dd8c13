"""A run's control channel beyond signals: ``control.jsonl`` in the run folder, one request a line.

``gputravel runs stop/resume/step`` signal the run's process (SIGTERM, SIGUSR1, SIGUSR2); an attached console
(``gputravel-console --attach RUN``) needs more: pause, step, resume, breakpoints by phase and cancel, each as
the console's own keys do them in-process. Any process that may write the run folder appends a request
(``{"action": "pause"}``, ``{"action": "break", "phase": "TRAIN", "on": true}``, ...; an O_APPEND write of
one short line, 0600); the run (``gputravel run``) reads new lines every ``POLL_S`` and hands each to the
engine's ``Control``, so a request lands as a key would: after the current training step, at the next chunk
in PROVISION, or between phases. The file is the run folder's only link between the two processes; it is
also the record of who asked what (each line names its sender and time). Cheap to import.

Consoles also use it among themselves: ``take`` and ``release`` (the run ignores both) say which attached console
steers. The newest ``take`` holds control while its console lives and has not released it by leaving
(:func:`controller`); a console that attaches while another holds it watches read-only until it takes control
(``:take``), and the one it took it from sees that at its next read of the run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gputravel.core.runfolder import RunFolder

__all__ = ["ACTIONS", "POLL_S", "RUN_ACTIONS", "ControlChannel", "ControlInbox", "apply_request", "controller",
           "send_control"]

POLL_S = 0.1
#: what the run applies to its engine's Control
RUN_ACTIONS = ("pause", "resume", "step", "break", "cancel")
#: every line the channel takes: the run's actions, ``take`` and ``release`` (consoles only: which one steers)
ACTIONS = (*RUN_ACTIONS, "take", "release")


def send_control(folder: Path, action: str, *, phase: str | None = None, on: bool | None = None,
                 sender: str = "gputravel", console: str | None = None) -> dict[str, Any]:
    """Append one request to the run's channel; the request as written (``console``: the id of the console that
    asks, which ``take`` claims control for)."""
    if action not in ACTIONS:
        raise ValueError(f"control action {action!r}: one of {', '.join(ACTIONS)}")
    request: dict[str, Any] = {"action": action, "t": time.time(), "sender": sender, "pid": os.getpid()}
    if console is not None:
        request["console"] = console
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

    def __init__(self, folder: Path, *, from_start: bool = False) -> None:
        self.path = RunFolder(Path(folder)).control
        try:
            self.offset = 0 if from_start else self.path.stat().st_size
        except OSError:
            self.offset = 0

    def read(self, actions: tuple[str, ...] = RUN_ACTIONS) -> list[dict[str, Any]]:
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
            if isinstance(request, dict) and request.get("action") in actions:
                out.append(request)
        return out


class ControlChannel:
    """The run's end of the channel: the requests read, applied to the engine's ``Control`` once it is built.

    A fresh run reads its channel from the start (``from_start``: its folder is new, so every line is for it; a
    console that starts a run may ask before the run's engine exists, e.g. the step of ``space``); a resumed run
    from its end. ``start_paused``: the run waits before its first phase (``gputravel run --start-paused``)."""

    def __init__(self, folder: Path, *, from_start: bool, start_paused: bool = False) -> None:
        self.inbox = ControlInbox(folder, from_start=from_start)
        self.start_paused = start_paused
        self.controls: list[Any] = []
        self.waiting: list[dict[str, Any]] = []  # asked before the engine (its Control) was built

    def attach(self, control: Any) -> None:
        """The engine's Control, built and not yet running: the pause it starts with, then what was asked."""
        if self.start_paused:
            control.pause()
        self.controls.append(control)
        self.poll()

    def poll(self) -> None:
        self.waiting.extend(self.inbox.read())
        if self.controls:
            for request in self.waiting:
                for control in self.controls:
                    apply_request(control, request)
            self.waiting.clear()


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def controller(folder: Path) -> dict[str, Any] | None:
    """The ``take`` line of the console that steers the run now: the newest ``take``, unless that console has
    left (its ``release``, or its process gone). None: no console holds control."""
    holder: dict[str, Any] | None = None
    for request in ControlInbox(folder, from_start=True).read(("take", "release")):
        if request["action"] == "take":
            holder = request
        elif holder is not None and request.get("console") == holder.get("console"):
            holder = None
    return holder if holder is not None and _alive(holder.get("pid")) else None


def run_breakpoints(folder: Path) -> set[str]:
    """The breakpoints a run has, as a console attaching to it must show them: its settings' (``--break-before``),
    then every ``break`` its channel asked, in order (walk 16: a run started with ``--break-before TRAIN`` and
    paused there read ``breakpoints none`` attached, and ``b`` would have set, not cleared, the one it had)."""
    from gputravel.core.phases import Phase

    breaks: set[str] = set()
    try:
        saved = json.loads(RunFolder(folder).settings.read_text())
    except (OSError, ValueError):
        saved = {}
    named = saved.get("breakpoints") if isinstance(saved, dict) else None
    for name in named if isinstance(named, list) else ():
        if str(name).upper() in Phase.__members__:
            breaks.add(str(name).upper())
    for request in ControlInbox(folder, from_start=True).read(("break",)):
        phase = str(request.get("phase", "")).upper()
        if phase not in Phase.__members__:
            continue
        on = request.get("on")
        if on is None:
            on = phase not in breaks
        (breaks.add if on else breaks.discard)(phase)
    return breaks


def apply_request(control: Any, request: dict[str, Any]) -> None:
    """One request on the engine's ``Control`` (core/travel/control.py), as the console's key would do it (the
    consoles' own lines, ``take`` and ``release``, ask nothing of the run)."""
    from gputravel.core.phases import Phase

    action = request["action"]
    if action not in RUN_ACTIONS:
        return
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
