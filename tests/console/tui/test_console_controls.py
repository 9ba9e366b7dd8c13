"""No accidental cancel, and a visible pending state (issue 25.2 and 25.5, the console's side).

Tab in the ``:`` line completes commands and keeps the focus; ``c`` and ``:cancel`` ask first; after the
request the status bar says CANCELLING... / PAUSING... until the engine confirms. Live runs on tiny data, as
in ``test_console.py``.
"""

from __future__ import annotations

from pathlib import Path

from helpers import until

from gputravel.console.tui.app import make_app
from gputravel.console.tui.screens.confirm import ConfirmScreen
from gputravel.console.tui.widgets.command_line import CommandLine, complete
from gputravel.console.tui.widgets.status_bar import StatusBar
from gputravel.core.ledger import read_rows
from tests.console.tui.test_console import SIZE, data_root, factory_for, live, screen_text

__all__ = ["data_root"]  # the module-scoped fixture, shared


def test_tab_completion_completes_commands_and_their_arguments() -> None:
    assert complete("ca") == ("cancel", ())
    assert complete("th") == ("theme ", ())  # a whole command that takes an argument: a space after it
    assert complete("theme high") == ("theme high-contrast", ())
    assert complete("break prov") == ("break PROVISION", ())
    line, hits = complete("s")
    assert line == "s" and hits == ("screenshot", "step")  # ambiguous: both listed, nothing filled in
    assert complete("bench al", {"bench": ("allreduce", "provision")}) == ("bench allreduce", ())


async def test_tab_in_the_command_line_completes_and_never_turns_the_rest_into_hotkeys(
        data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), record=False, breakpoints=("ATTEST",))
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        await pilot.press("r")
        await until(pilot, lambda: bridge.state.paused_before == "ATTEST", what="the pause before ATTEST")
        await pilot.press("colon", "c", "a", "tab")
        line = app.screen.query_one(CommandLine)
        assert line.value == "cancel" and line.has_focus  # completed; the focus stays in the line
        await pilot.press("n", "c", "e", "l")  # the old console turned these into hotkeys: c cancelled
        await pilot.pause()
        assert line.value == "cancelncel" and app.run_in_flight and not isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not line.has_class("-open") and line.value == ""  # no stale text under the log
        await pilot.press("c")  # asks first
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and "Cancel the run?" in screen_text(app)
        await pilot.press("space", "c", "n")  # only y or n count; n: the run goes on
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen) and app.run_in_flight
        assert bridge.state.paused_before == "ATTEST" and bridge.state.phases_completed == 0
        await pilot.press("colon", *"cancel", "enter")  # :cancel asks too
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause(0)
        app.render_state()
        summary = app.screen.query_one(StatusBar).summary
        assert summary is not None
        assert summary.status in ("cancelling...", "cancelled")  # pending until the engine confirms
        await until(pilot, lambda: bridge.state.status == "cancelled" and not app.run_in_flight, what="cancelled")
        assert "CANCELLED" in screen_text(app) and "CANCELLING" not in screen_text(app)


async def test_cancel_and_pause_show_a_pending_state_until_the_engine_confirms(
        data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), record=False, breakpoints=("PROVISION",))
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        await pilot.press("r")
        await until(pilot, lambda: bridge.state.paused_before == "PROVISION", what="the pause before PROVISION")
        bridge.resume()
        assert bridge.toggle_pause() == "pausing: after the current training step, else before the next phase"
        assert bridge.shown_status() == "pausing..."  # asked for; the engine has not stopped yet
        await until(pilot, lambda: bridge.state.paused_before is not None, what="the pause")
        assert bridge.shown_status() is None and "PAUSED BEFORE" in screen_text(app)
        bridge.cancel()
        assert bridge.shown_status() == "cancelling..."  # same call: nothing has confirmed it yet
        app.render_state()
        assert "CANCELLING..." in screen_text(app)
        await until(pilot, lambda: bridge.state.status == "cancelled" and not app.run_in_flight, what="cancelled")
        assert bridge.shown_status() is None and "CANCELLED" in screen_text(app)
        # the cancelled visit's scrub receipt is its ledger row's (the abort scrubbed the buffer)
        ledger = bridge.ledger_path
        assert ledger is not None
        row = next(r for r in read_rows(ledger) if r.kind == "visit-cancelled")
        assert row.detail["visit"] == 0 and row.detail["scrub_verified"] is True
        visit = bridge.state.visit(0)
        assert visit is not None and visit.outcome == "cancelled" and visit.scrub_verified is True
        line = next(t for t in screen_text(app).splitlines() if t.lstrip().startswith("1 "))
        cells = line.split()
        assert cells[cells.index("cancelled") - 1] == "✓", line  # the scr cell: ✓, not ·
