"""One console steers a run at a time (issue 35.1): the first to attach takes control; a second attaching to the
same run watches read-only until ``:take``, which the first one sees and turns read-only in turn. ``q`` on a run
the console steers asks detach / cancel / stay. Pilot on the real app and the real channel (``control.jsonl``)
of a run folder whose recording is mid-run (no process behind it: what is checked is what each console writes
and shows); and a run the console starts that refuses its input (a real ``gputravel run`` process, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import control_lines as lines
from helpers import recorded_run, until

from gputravel.console.cli.launch import Launcher
from gputravel.console.tui.app import make_app
from gputravel.console.tui.attach_bridge import AttachedBridge
from gputravel.console.tui.screens.confirm import QuitScreen
from gputravel.core.runfolder import RunFolder


async def test_a_second_console_watches_until_it_takes_control_and_the_first_sees_it(tmp_path: Path) -> None:
    folder = recorded_run(tmp_path / "run", run_id="take0001")
    first = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with first.run_test(size=(120, 40)) as p1:
        one = first.bridge
        assert isinstance(one, AttachedBridge) and one.in_control and "ATTACHED" in first.badges
        second = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
        async with second.run_test(size=(120, 40)) as p2:
            two = second.bridge
            assert isinstance(two, AttachedBridge)
            assert two.watching and second.readonly and "READ-ONLY · :take" in second.badges
            await p2.press("p", "space", "c")  # refused: another console steers
            assert [(r["action"], r["console"]) for r in lines(folder)] == [("take", one.control.console_id)]
            await p2.press("colon", *"take", "enter")
            assert lines(folder)[-1]["action"] == "take" and lines(folder)[-1]["console"] == two.control.console_id
            assert two.in_control and not second.readonly and "ATTACHED" in second.badges
            await until(p1, lambda: one.watching, timeout=5, what="the first console seeing :take")
            assert first.readonly and "READ-ONLY · :take" in first.badges
            await p1.press("p")  # the first one no longer steers
            await p2.press("p")  # the second one does
            assert [(r["action"], r["console"]) for r in lines(folder)][-1] == ("pause", two.control.console_id)
            assert [r["action"] for r in lines(folder)].count("pause") == 1
        await p1.press("colon", *"take", "enter")  # and takes it back
        assert one.in_control and lines(folder)[-1]["console"] == one.control.console_id
    assert lines(folder)[-1] == {**lines(folder)[-1], "action": "release", "console": one.control.console_id}


async def test_q_on_a_steered_run_asks_detach_cancel_or_stay(tmp_path: Path) -> None:
    folder = recorded_run(tmp_path / "run", run_id="take0001")
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("q", "x")  # other keys do nothing while it asks
        await pilot.pause()
        assert isinstance(app.screen, QuitScreen) and app.is_running
        await pilot.press("escape")  # stay
        await pilot.pause()
        assert not isinstance(app.screen, QuitScreen) and app.is_running
        await pilot.press("q", "c")  # cancel the run, and leave
    assert app.left_how == "cancel" and [r["action"] for r in lines(folder)][-2:] == ["cancel", "release"]
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("q", "d")  # detach: nothing asked of the run
    assert app.left_how == "detach" and [r["action"] for r in lines(folder)][-3:] == ["release", "take", "release"]


@pytest.mark.process
async def test_a_started_run_that_refuses_its_input_shows_failed_with_what_it_said(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's own run is a ``gputravel run`` process: one that exits before its final event (here its
    settings refused, exit 2, no run folder) is FAILED on screen with its error line, and nothing is left live."""
    monkeypatch.chdir(tmp_path)
    launcher = Launcher(run_args=("--transport", "local", "--rounds", "0"), out=tmp_path / "run")
    app = make_app(launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("r")
        bridge = app.bridge
        assert launcher.last is not None
        await until(pilot, lambda: bridge.shown_status() == "failed", timeout=60, what="the run's refusal")
        assert launcher.last.exit_code() == 2 and not bridge.run_live
        assert "exited 2" in (bridge.state.error or "") and "rounds" in (bridge.state.error or "")
        await pilot.press("q")  # no run to ask about: the console leaves at once
    assert app.left_how == "quit" and not (tmp_path / "run").exists()
