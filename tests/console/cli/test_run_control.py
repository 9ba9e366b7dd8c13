"""The run's control channel (``control.jsonl``, console/cli/run_control.py) on the engine's real ``Control``:
a fresh run reads what a console asked before its engine existed, a resumed run only what comes after it
started; ``--start-paused`` pauses before what was asked is applied; ``take`` / ``release`` are the consoles'
(the run ignores them) and say which console steers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gputravel.console.cli.run_control import ControlChannel, controller, send_control
from gputravel.core.phases import Phase
from gputravel.core.travel.control import Control


def test_a_fresh_run_applies_what_was_asked_before_its_engine_existed(tmp_path: Path) -> None:
    send_control(tmp_path, "take", console="c1")
    send_control(tmp_path, "step")
    send_control(tmp_path, "break", phase="train", on=True)
    channel = ControlChannel(tmp_path, from_start=True, start_paused=True)
    channel.poll()  # the engine is not built yet: the requests wait
    assert channel.waiting and [r["action"] for r in channel.waiting] == ["step", "break"]  # take is not the run's
    control = Control()
    channel.attach(control)
    assert control.paused is False  # paused by --start-paused, then one step asked: one phase may run
    assert control.breakpoints == {Phase.TRAIN} and not channel.waiting
    send_control(tmp_path, "pause")
    channel.poll()
    assert control.paused


def test_a_resumed_run_skips_what_its_earlier_part_was_asked(tmp_path: Path) -> None:
    send_control(tmp_path, "cancel")
    channel = ControlChannel(tmp_path, from_start=False)
    control = Control()
    channel.attach(control)
    assert not control.cancelled
    send_control(tmp_path, "cancel")
    channel.poll()
    assert control.cancelled


def test_the_newest_take_of_a_live_console_steers_until_it_releases(tmp_path: Path) -> None:
    assert controller(tmp_path) is None
    send_control(tmp_path, "take", console="first")
    send_control(tmp_path, "take", console="second")
    held = controller(tmp_path)
    assert held is not None and held["console"] == "second"
    send_control(tmp_path, "release", console="first")  # not the holder's: nothing changes
    assert controller(tmp_path)["console"] == "second"  # type: ignore[index]
    send_control(tmp_path, "release", console="second")
    assert controller(tmp_path) is None
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    path = tmp_path / "control.jsonl"
    with path.open("a") as f:  # a console whose process has ended holds nothing
        f.write(f'{{"action": "take", "console": "dead", "pid": {int(gone.stdout)}, "t": 0}}\n')
    assert controller(tmp_path) is None
