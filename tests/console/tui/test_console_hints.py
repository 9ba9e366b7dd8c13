"""What the console offers is what works there (issue 35.4): the bench screen of a replay says benchmarks
cannot run there and offers no run key; Tab completes bench names in the ``:`` line; at 80 columns the footer
keeps ``r``, ``c``, ``:``, ``?`` and ``q``. Pilot on the real app: a synthetic recording (as the snapshot tests),
a live console whose engine is never built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputravel.console.tui.app import make_app
from gputravel.console.tui.screens.bench import BENCH_ARGS, BenchScreen
from gputravel.console.tui.widgets.command_line import CommandLine
from gputravel.core.recording import load_recording
from tests.console.tui.test_console import data_root
from tests.console.tui.test_console_snapshots import screen_text, settle, synthetic_run


def never_built() -> Any:
    raise AssertionError("the engine must not be built")


async def test_the_bench_screen_of_a_replay_says_benchmarks_cannot_run_there(tmp_path: Path) -> None:
    started: list[str] = []

    async def runner(name: str, on_line: Any) -> Any:
        started.append(name)
        return {}

    app = make_app(replay=load_recording(synthetic_run(tmp_path / "recording.db")), bench_runner=runner)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        await settle(pilot, app)
        assert isinstance(app.screen, BenchScreen)
        text = screen_text(app)
        assert "benchmarks cannot run here" in text and "this recording holds no benchmark results" in text
        footer = text.splitlines()[-1]
        assert "Run bench" not in footer and "Stop bench" not in footer  # the keys that did nothing are gone
        await pilot.press("enter")
        await settle(pilot, app)
        assert started == [] and "benchmarks cannot run here" in screen_text(app)


async def test_tab_completes_bench_names_in_the_command_line() -> None:
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("colon", *"bench pr", "tab")
        line = app.screen.query_one(CommandLine)
        assert line.value == "bench provision" and line.has_focus
        await pilot.press("ctrl+u", *"bench ", "tab")  # every bench the screen offers is a candidate
        assert set(line.extra_words["bench"]) == set(BENCH_ARGS)


async def test_the_footer_keeps_run_cancel_command_help_and_quit_at_80_columns() -> None:
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        footer = screen_text(app).splitlines()[-1]
        for key in ("r Run", "c Cancel", ": :cmd", "? Help", "q Quit"):
            assert key in footer, footer
        assert footer.index("r Run") < footer.index("c Cancel") < footer.index("? Help") < footer.index("q Quit")


async def test_q_on_a_run_this_console_drives_asks_before_it_cancels(data_root: Path, tmp_path: Path) -> None:
    """``q`` cancelled a run in TRAIN without asking (issue 35.1): now it asks, ``n`` stays, ``y`` cancels and
    leaves (an attached run, test_console_attach.py, is left at once and goes on)."""
    from helpers import until

    from gputravel.console.tui.screens.confirm import ConfirmScreen
    from tests.console.tui.test_console import factory_for, live

    app = make_app(engine_factory=factory_for(data_root, tmp_path), record=False, breakpoints=("ATTEST",))
    async with app.run_test(size=(120, 40)) as pilot:
        bridge = live(app)
        await pilot.press("r")
        await until(pilot, lambda: bridge.state.paused_before == "ATTEST", what="the pause before ATTEST")
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and "Quit and cancel the run?" in screen_text(app)
        await pilot.press("n")
        await pilot.pause()
        assert app.run_in_flight and not isinstance(app.screen, ConfirmScreen)
        await pilot.press("q", "y")
        await until(pilot, lambda: bridge.state.status == "cancelled" and not app.run_in_flight, what="cancelled")


__all__ = ["data_root"]  # the module-scoped fixture of test_console.py, shared
