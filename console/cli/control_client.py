"""A console's end of a run's control channel (``console/cli/run_control.py``): who steers, and what it asked.

:class:`ControlClient` owns what one console knows of the channel of one run folder: its id, whether it holds
control (the first to attach takes it; another that attaches watches until ``:take``), the console that holds it
otherwise, the breakpoints it set, and every request it wrote. A request asked before the run has made its folder
(a run the console just started) waits in ``queued`` and is written, in order, once the folder exists.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from gputravel.console.cli.run_control import controller, send_control
from gputravel.core.phases import Phase

__all__ = ["SENDER", "ControlClient"]

SENDER = "gputravel-console --attach"


class ControlClient:
    """One console's requests on one run's channel (``folder`` None: no run yet, every request is dropped)."""

    def __init__(self, folder: Path | None, *, breaks: set[Phase] | None = None) -> None:
        self.folder = folder
        self.console_id = uuid.uuid4().hex[:12]
        #: whether this console steers the run (else it watches, read-only, until :take)
        self.in_control = False
        #: the console that holds control, where another does (its take line)
        self.holder: dict[str, Any] | None = None
        self.breaks: set[Phase] = breaks if breaks is not None else set()  # the breakpoints this console set
        self.sent: list[dict[str, Any]] = []  # what this console asked, in order (the channel holds it too)
        self.queued: list[tuple[str, dict[str, Any]]] = []  # asked before the run's folder exists

    def follow_run(self, folder: Path) -> None:
        """A run this console just started (its folder not made yet): it steers it from its start."""
        self.folder = folder
        self.queued.clear()
        self.in_control, self.holder = True, None

    @property
    def waiting(self) -> bool:
        """The run has a folder to be, not made yet (requests queue)."""
        return self.folder is not None and not self.folder.is_dir()

    def claim(self) -> None:
        """Attaching: take control unless another live console holds it (then watch until :take)."""
        assert self.folder is not None
        held = controller(self.folder)
        if held is None or held.get("console") == self.console_id:
            self.take()
        else:
            self.holder = held

    def take(self) -> None:
        """``:take``: this console steers the run from now on (queued until the run's folder exists)."""
        if self.waiting:
            self.queued.append(("take", {}))
        elif self.folder is not None:
            self.flush()
            self.sent.append(send_control(self.folder, "take", sender=SENDER, console=self.console_id))
        self.in_control, self.holder = True, None

    def lost(self) -> dict[str, Any] | None:
        """The take line of another console that took control since (this one now watches); None: no change."""
        if self.folder is None or not self.in_control or self.waiting:
            return None
        held = controller(self.folder)
        if held is None or held.get("console") == self.console_id:
            return None
        self.in_control, self.holder = False, held
        return held

    def send(self, action: str, **kw: Any) -> None:
        """One request of the console in control (one that watches asks nothing)."""
        if self.folder is None or not self.in_control:
            return
        if self.waiting:
            self.queued.append((action, kw))
            return
        self.flush()
        self.sent.append(send_control(self.folder, action, sender=SENDER, console=self.console_id, **kw))

    def flush(self) -> None:
        """Write what was asked before the run made its folder (it is the run's to create), in order."""
        if self.folder is None or self.waiting:
            return
        while self.queued:
            action, kw = self.queued.pop(0)
            self.sent.append(send_control(self.folder, action, sender=SENDER, console=self.console_id, **kw))

    def toggle_break(self, phase: Phase) -> bool:
        """A breakpoint before ``phase`` on or off (asked of the run); True when it is now on."""
        on = phase not in self.breaks
        (self.breaks.add if on else self.breaks.discard)(phase)
        self.send("break", phase=str(phase), on=on)
        return on

    def release(self) -> None:
        """Leaving: control is given up (a console attaching next takes it)."""
        if self.folder is not None and self.in_control and self.folder.is_dir():
            send_control(self.folder, "release", sender=SENDER, console=self.console_id)
            self.in_control = False
