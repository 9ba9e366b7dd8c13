"""What an operator tripped on in the console (operator walk, session 15).

Attaching to a run that has ended: ``gputravel-console --attach RUN`` on a completed
or cancelled run. Its keys had been written to the ended run's ``control.jsonl`` without a word (``r``, ``space``),
or answered as for a replay (``c``: "a replay has no run to cancel"; ``p``: "pausing: after the current training
step"). Each now says the run has ended, a run that did not complete names how to continue it, and nothing is
written to the channel but the console's own ``take``/``release``. Pilot on the real app and a real run folder's
recording and channel (no process behind it: what is checked is what the console writes and says)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import control_lines, recorded_run, until
from textual.pilot import Pilot

from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.attach_bridge import AttachedBridge
from gputravel.core import events as ev
from gputravel.core.recording import Recorder
from gputravel.core.runfolder import RunFolder
from gputravel.core.telemetry import GpuSample, NvmlStatus, TelemetryFrame


def actions(folder: Path) -> list[str]:
    return [str(line["action"]) for line in control_lines(folder)]


def notices(app: GpuTravelConsole) -> list[str]:
    return [n.message for n in app._notifications]


async def shown_ended(app: GpuTravelConsole, pilot: Pilot[None], status: str) -> None:
    """The console attached to a run folder shows the run ``status`` and knows no live process behind it."""
    bridge = app.bridge
    assert isinstance(bridge, AttachedBridge)
    await until(pilot, lambda: bridge.shown_status() == status, timeout=10, what=f"the run shown {status}")
    assert not bridge.run_live


@pytest.mark.parametrize("final, status", [
    (ev.RunFailed(1001.0, "ended001", "cancelled (interrupted)", "cancelled"), "cancelled"),
    (ev.RunCompleted(1001.0, "ended001", 1, 0, 1.0), "completed"),
])
async def test_the_keys_of_an_attached_run_that_has_ended_say_so_and_write_nothing(
        tmp_path: Path, final: ev.Event, status: str) -> None:
    folder = recorded_run(tmp_path / "run", final, run_id="ended001")
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(80, 24)) as pilot:
        await shown_ended(app, pilot, status)
        for key in ("r", "space", "p"):
            app.clear_notifications()
            await pilot.press(key)
            await until(pilot, lambda: notices(app), timeout=5, what=f"an answer to {key}")
            said = notices(app)[-1]
            assert said.startswith(f"the run has ended ({status}): there is nothing to steer"), (key, said)
            assert ("gputravel run --resume --out " + str(folder) in said) is (status != "completed"), said
        app.clear_notifications()
        await pilot.press("c")
        await until(pilot, lambda: notices(app), timeout=5, what="an answer to c")
        assert notices(app)[-1] == f"no run in progress (the last one {status})"
        assert not app.check_action("toggle_break", ()) and not app.check_action("toggle_breakpoint", ("TRAIN",))
        assert actions(folder) == ["take"]  # only the console's own claim: no request to a run that reads none
    assert actions(folder) == ["take", "release"]


async def test_the_gpu_screen_of_an_attached_run_names_its_sampler_not_a_replay(tmp_path: Path) -> None:
    """Attached to a live run, the GPU screen said ``source replay``: the frames are the run's own live samples,
    read from its recording. A replay (``--replay``, not following) still says ``replay``."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    rec = Recorder(RunFolder(folder).recording, meta={"settings": {"holders": 1}})
    rec(ev.RunStarted(1000.1, "live0001", {"kind": "emulated", "sim": True, "device": "cpu", "notes": []},
                      ("alice",), 1))
    rec(ev.PhaseStarted(1000.2, 0, "alice", "TRAIN", 1))
    rec.record_telemetry(TelemetryFrame(t=1000.3, source="emulated", nvml=NvmlStatus(False, "no driver"),
                                        devices=(GpuSample(index=0, name="emu", sim=True),), phase="alice · TRAIN"))
    rec.close()
    for attach, said in ((folder, "source emulated · read from the run's recording"), (None, "source replay")):
        app = make_app(replay=RunFolder(folder).recording, follow=attach is not None, attach=attach)
        async with app.run_test(size=(80, 24)) as pilot:
            if attach is None:
                await pilot.press("end")  # a replay opens at its start: to the frame
            await pilot.press("4")

            await until(pilot, lambda a=app, s=said: s in str(a.screen.query_one("#nvml-status").render()),
                        timeout=10, what=f"{said!r} on the GPU screen")


@pytest.mark.parametrize("written, shown", [
    ({"status": "failed", "code": "disk-full"}, "failed: disk full"),  # status.json, in the room the run kept
    (None, "died"),  # nothing written, the process gone: as `gputravel runs` says
])
async def test_an_attached_run_a_full_disk_stopped_reads_as_runs_show_says_not_running(
        tmp_path: Path, written: dict[str, str] | None, shown: str) -> None:
    """Operator walk (session 16): ``--attach`` a run that a full disk stopped read RUNNING, ATTACHED, its keys
    offered: the disk refused the recording's ``RunFailed``. The console reads what ``gputravel runs show``
    reads (``status.json``, the run's process), says it in the status bar and its keys say the run has ended."""
    import subprocess
    import sys

    from gputravel.console.view.run_info import read_run
    from gputravel.core.runfolder import write_status

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    rec = Recorder(RunFolder(folder).recording, meta={"settings": {"holders": 1}, "pid": int(gone.stdout)})
    rec(ev.RunStarted(1000.1, "ended001", {"kind": "emulated", "sim": True}, ("alice",), 1))
    rec(ev.PhaseStarted(1000.5, 0, "alice", "ROTATE", 1))  # then the full disk: no final event
    rec.close()
    if written is not None:
        write_status(folder, written["status"], run_id="ended001", error="DiskFullError: ... no space left",
                     code=written["code"])
    assert read_run(folder).word == shown
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(80, 24)) as pilot:
        await shown_ended(app, pilot, shown)
        await until(pilot, lambda: shown.upper() in str(app.screen.query_one("#status-bar").render()),
                    timeout=5, what="the status bar")
        app.clear_notifications()
        await pilot.press("space")
        await until(pilot, lambda: notices(app), timeout=5, what="an answer to space")
        assert notices(app)[-1].startswith(f"the run has ended ({shown}): there is nothing to steer")
        assert actions(folder) == ["take"]


async def test_an_attached_run_shows_the_breakpoints_it_was_started_with_and_those_asked_since(
        tmp_path: Path) -> None:
    """Operator walk (session 16): a run started with ``--break-before TRAIN`` and paused there read
    ``breakpoints none`` attached (the console knew only the breakpoints it set itself), so ``b`` on TRAIN
    would have set the one it had. Its settings' breakpoints and its channel's ``break`` lines are its own."""
    from gputravel.console.cli.run_control import run_breakpoints, send_control

    folder = recorded_run(tmp_path / "run", ev.RunPaused(1000.5, "breakpoint", "TRAIN"))
    RunFolder(folder).settings.write_text(json.dumps({"breakpoints": ["TRAIN", "VERIFY"]}))
    send_control(folder, "break", phase="provision", on=True)
    send_control(folder, "break", phase="VERIFY", on=False)
    assert run_breakpoints(folder) == {"TRAIN", "PROVISION"}
    app = make_app(replay=RunFolder(folder).recording, follow=True, attach=folder)
    async with app.run_test(size=(120, 40)) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, AttachedBridge)
        assert bridge.breaks == {"TRAIN", "PROVISION"}
        await until(pilot, lambda: "breakpoints PROVISION, TRAIN" in str(app.screen.query_one("#visit-detail").render()),
                    timeout=10, what="the run's breakpoints in the panel")
