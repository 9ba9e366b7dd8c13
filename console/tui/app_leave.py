"""Leaving the console, and cancelling a run: the questions asked first (a part of
:class:`~gputravel.console.tui.app.GpuTravelConsole`, which holds it as ``leaving``).

A run this console steers (its own, started as a headless process, or ``--attach``) is asked about on ``q``:
detach (it goes on), cancel it, or stay; one that runs inside this process (an embedded engine) would die with
the console: that is asked first. ``how`` says how the console was left, for the command that started it."""

from __future__ import annotations

from typing import Protocol

from textual.app import App

from gputravel.console.tui.bridge import Bridge
from gputravel.console.tui.screens.confirm import ConfirmScreen, QuitScreen

__all__ = ["Leaving", "RunHost"]


class RunHost(Protocol):
    """What the questions read of the app: its bridge, and whether its run's worker is still going."""

    bridge: Bridge

    @property
    def run_in_flight(self) -> bool: ...


class Leaving:
    """The cancel and quit questions of one console (``app`` its Textual side, ``host`` the same app's run)."""

    def __init__(self, app: App[None], host: RunHost) -> None:
        self.app = app
        self.host = host
        #: how the console was left: "detach" (the run goes on), "cancel" (asked to cancel it), or "quit"
        self.how = "quit"

    def confirm_cancel(self) -> None:
        if isinstance(self.app.screen, ConfirmScreen):
            return
        bridge = self.host.bridge

        def answered(yes: bool | None) -> None:
            if yes and (self.host.run_in_flight or bridge.attached):
                bridge.cancel()
                self.app.notify("cancelling: the visit is aborted, the buffer scrubbed", timeout=3)
            elif not yes:
                self.app.notify("not cancelled: the run goes on", timeout=2)

        self.app.push_screen(ConfirmScreen("Cancel the run?", "The visit is aborted, the buffer scrubbed, and the "
                                           "run ends (it cannot be resumed)."), answered)

    def request_quit(self) -> None:
        app, bridge = self.app, self.host.bridge
        if isinstance(app.screen, (ConfirmScreen, QuitScreen)):
            app.exit()
            return
        if bridge.attached and bridge.in_control and bridge.run_live:
            app.push_screen(QuitScreen(), self.left)
            return
        if not (bridge.live and self.host.run_in_flight):
            app.exit()
            return

        def answered(yes: bool | None) -> None:
            if yes:
                bridge.cancel()
                app.exit()
            else:
                app.notify("not quit: the run goes on", timeout=2)

        app.push_screen(ConfirmScreen(
            "Quit and cancel the run?", "This run runs inside the console's own process: leaving cancels it (the "
            "visit is aborted, the buffer scrubbed). Runs the console starts with r go on when it leaves."),
            answered)

    def left(self, how: str | None) -> None:
        """The quit question's answer: detach, cancel, or (None) stay."""
        if how == "detach":
            self.how = "detach"
            self.app.exit()
        elif how == "cancel":
            self.host.bridge.cancel()
            self.how = "cancel"
            self.app.exit()
        else:
            self.app.notify("not quit: the run goes on, steered here", timeout=2)
