"""Progress inside TRAIN and control within one step: a real device service, real agents, real torch.

TRAIN runs as slices of device requests (``core.travel.training``); these tests cut every slice to a fixed
number of steps (``engine.train_slices.max_steps``) so the step a control lands on is exact, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import running, small_settings, started

from gputravel.console.cli import main as cli
from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import CancelledRunError
from gputravel.core.ledger import LedgerRow, read_rows, verify_ledger
from gputravel.core.phases import Phase
from gputravel.core.recording import load_recording
from gputravel.core.travel.training import SliceSettings, SpikeWatch

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

def small(data: Path, out: Path, **kw: Any) -> RunSettings:
    """The small run with twelve steps a visit (``data_root``: conftest.py)."""
    return small_settings(data, out, **{"steps_per_visit": 12, **kw})


def rows_of(out: Path, kind: str) -> list[LedgerRow]:
    return [r for r in read_rows(out / "ledger.db") if r.kind == kind]


async def next_event(q: asyncio.Queue[ev.Event], kind: type[ev.Event], timeout: float = 60) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            event = await q.get()
            if isinstance(event, kind):
                return event


def drain(q: asyncio.Queue[ev.Event]) -> list[ev.Event]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


# --- progress ------------------------------------------------------------------------------------
async def test_progress_events_arrive_during_train_and_add_up_to_the_phase(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    events: list[ev.Event] = []
    async with started(small(data_root, out, steps_per_visit=10)) as engine:
        engine.train_slices = SliceSettings(budget_s=600.0, max_steps=3)  # slices of 3, 3, 3, 1 steps, whatever the load
        engine.bus.sinks.append(events.append)
        report = (await engine.run()).to_json()

    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    progress = [e for e in events if isinstance(e, ev.TrainingProgressed)]
    stepped = [e for e in events if isinstance(e, ev.TrainingStepped)]
    assert len(progress) == 6  # 3 a visit: after steps 3, 6 and 9 of 10 (the last slice ends the phase)
    for visit, closing in enumerate(stepped):
        mine = [e for e in progress if e.visit == visit]
        assert [(e.step, e.steps) for e in mine] == [(3, 10), (6, 10), (9, 10)]
        assert [x for e in mine for x in e.losses] == list(closing.losses[:9])  # the same steps, as they came
        assert all(e.loss == e.losses[-1] and e.tokens_per_s > 0 for e in mine)
        assert [e.run_step for e in mine] == [10 * visit + 3, 10 * visit + 6, 10 * visit + 9]
    # each progress event comes inside its visit's TRAIN: after TRAIN started, before it completed
    kinds = [(type(e).__name__, getattr(e, "phase", None)) for e in events]
    first_train = kinds.index(("PhaseStarted", "TRAIN"))
    first_done = kinds.index(("PhaseCompleted", "TRAIN"))
    assert all(first_train < i < first_done for i, e in enumerate(events)
               if isinstance(e, ev.TrainingProgressed) and e.visit == 0)
    assert report["training"]["steps"] == 20 and report["ledger"]["verified"]


# --- cancel and pause within one step ------------------------------------------------------------
async def test_cancel_mid_train_lands_after_the_current_step_and_scrubs(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    events: list[ev.Event] = []
    async with started(small(data_root, out, steps_per_visit=200)) as engine:
        engine.train_slices = SliceSettings(max_steps=1)  # one optimizer step per request

        def cancel_at_step_3(event: ev.Event) -> None:
            events.append(event)
            if isinstance(event, ev.TrainingProgressed) and event.step == 3:
                engine.control.cancel()

        engine.bus.sinks.append(cancel_at_step_3)
        with pytest.raises(CancelledRunError):
            await engine.run()

    # 3 of 200 steps ran: the cancel landed between step 3 and step 4, not at the end of the phase
    assert len(engine.walk.records[0].losses) == 3 and engine.log.step_count == 3
    requested = [e for e in events if isinstance(e, ev.ControlRequested)]
    assert [(e.action, e.phase) for e in requested] == [("cancel", "TRAIN")]
    cancelled = [e for e in events if isinstance(e, ev.VisitCancelled)]
    assert [(e.visit, e.phase, e.steps, e.scrub_verified) for e in cancelled] == [(0, "TRAIN", 3, True)]
    assert events.index(requested[0]) < events.index(cancelled[0])
    assert not any(isinstance(e, ev.TrainingStepped | ev.VisitCompleted) for e in events)
    row, = rows_of(out, "visit-cancelled")
    assert (row.phase, row.outcome) == ("TRAIN", "cancelled")
    assert row.detail["steps"] == 3 and row.detail["scrub_verified"] is True and row.detail["visit"] == 0
    assert rows_of(out, "run-failed")[-1].outcome == "cancelled"
    assert verify_ledger(out / "ledger.db").ok


async def test_interrupt_mid_train_still_scrubs_and_records_the_cancelled_visit(data_root: Path,
                                                                               tmp_path: Path) -> None:
    """SIGTERM (``runs stop``) and Ctrl-C cancel the run's task: the visit is cancelled as by the operator."""
    out = tmp_path / "run"
    async with started(small(data_root, out, steps_per_visit=200)) as engine:
        engine.train_slices = SliceSettings(max_steps=1)
        task = asyncio.ensure_future(engine.run())

        def interrupt_at_step_2(event: ev.Event) -> None:
            if isinstance(event, ev.TrainingProgressed) and event.step == 2:
                task.cancel()  # what the SIGTERM handler of `gputravel run` does

        engine.bus.sinks.append(interrupt_at_step_2)
        with pytest.raises(asyncio.CancelledError):
            await task

    row, = rows_of(out, "visit-cancelled")
    assert row.phase == "TRAIN" and row.detail["scrub_verified"] is True
    assert row.detail["steps"] == 2  # recorded steps; the step in flight when it landed finished on the device
    assert engine.walk.records[0].outcome == "cancelled"
    assert rows_of(out, "run-failed")[-1].outcome == "cancelled"
    assert verify_ledger(out / "ledger.db").ok


async def test_pause_mid_train_pauses_after_the_current_step_then_resumes(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with started(small(data_root, out, steps_per_visit=12)) as engine:
        engine.train_slices = SliceSettings(max_steps=1)
        q = engine.subscribe()

        def pause_at_step_4(event: ev.Event) -> None:
            if isinstance(event, ev.TrainingProgressed) and event.visit == 0 and event.step == 4:
                engine.control.pause()

        engine.bus.sinks.append(pause_at_step_4)
        async with running(engine) as task:
            asked = await next_event(q, ev.ControlRequested)
            paused = await next_event(q, ev.RunPaused)
            assert (asked.action, asked.phase) == ("pause", "TRAIN")
            assert (paused.reason, paused.next_phase, paused.within) == ("paused", "TRAIN", "TRAIN 4/12")
            assert engine.control.paused_at == Phase.TRAIN
            assert len(engine.walk.records[0].losses) == 4
            await asyncio.sleep(0.3)  # paused means paused: no step runs
            assert len(engine.walk.records[0].losses) == 4
            assert not any(isinstance(e, ev.TrainingProgressed) for e in drain(q))
            engine.control.resume()
            report = (await asyncio.wait_for(task, 120)).to_json()
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    assert report["training"]["steps"] == 24 and report["ledger"]["verified"]


async def test_step_from_a_mid_train_pause_finishes_the_phase_and_pauses_before_the_next(data_root: Path,
                                                                                        tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with started(small(data_root, out, steps_per_visit=6)) as engine:
        engine.train_slices = SliceSettings(max_steps=1)
        q = engine.subscribe()
        engine.bus.sinks.append(lambda e: engine.control.pause()
                            if isinstance(e, ev.TrainingProgressed) and e.visit == 0 and e.step == 2 else None)
        async with running(engine) as task:
            paused = await next_event(q, ev.RunPaused)
            assert paused.within == "TRAIN 2/6"
            engine.control.step()  # the rest of TRAIN is the step
            paused = await next_event(q, ev.RunPaused)
            assert (paused.reason, paused.next_phase, paused.within) == ("step", "SCRUB", None)
            assert len(engine.walk.records[0].losses) == 6
            engine.control.resume()
            report = (await asyncio.wait_for(task, 120)).to_json()
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]


# --- loss spikes -----------------------------------------------------------------------------------
def test_spike_watch_flags_a_jump_once_and_not_a_descent() -> None:
    watch = SpikeWatch(factor=1.75, warmup=5)
    descent = [5.5, 5.2, 4.9, 4.6, 4.3, 4.1, 3.9, 3.7, 4.3, 3.3, 3.1, 2.9]  # noisy, falling: never a spike
    assert [watch.feed(x) for x in descent] == [None] * len(descent)
    mean = watch.mean
    assert watch.feed(3 * mean) == pytest.approx(mean)  # the jump is flagged with the mean before it
    assert watch.feed(4 * mean) is None  # the same episode
    for _ in range(60):
        watch.feed(2.0)  # back to normal
    assert watch.feed(10.0) is not None  # a new episode is flagged again


def test_cli_flags_a_learning_rate_blow_up_in_its_output_and_recording(data_root: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       request: pytest.FixtureRequest) -> None:
    """lr 1.0: the loss blows up a few steps after warm-up (5.5 -> 20+ on this data): one flag, in the CLI's
    output and in the recording, and the run still completes."""
    out = tmp_path / "run"
    umask = os.umask(0o022)  # the run makes this process's umask private (0077): the tests after keep theirs
    os.umask(umask)
    request.addfinalizer(lambda: os.umask(umask))
    monkeypatch.setattr(sys, "argv", ["gputravel", "run", "--data", str(data_root), "--holders", "2", "--rounds",
                                      "1", "--steps-per-visit", "12", "--batch-size", "4", "--seq-len", "32",
                                      "--chunk-kib", "16", "--buffer-mib", "0.25", "--lr", "1.0", "--transport",
                                      "local", "--out", str(out)])
    with pytest.raises(SystemExit) as info:
        cli.main()
    text = "".join(capsys.readouterr().out.split())
    assert info.value.code in (0, None)
    assert "lossspike" in text and "xrunningmean" in text
    recorded = load_recording(out / "recording.db").events()
    spikes = [e for e in recorded if isinstance(e, ev.LossSpiked)]
    assert len(spikes) >= 1 and all(s.loss > s.factor * s.mean for s in spikes)
    assert Counter(type(e).__name__ for e in recorded)["TrainingStepped"] == 2


# --- the console: steps as they come -------------------------------------------------------------
def _screen_text(app: Any, size: tuple[int, int]) -> str:
    import io

    from rich.console import Console

    console = Console(width=size[0], height=size[1], file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return str(console.export_text())


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_training_screen_shows_steps_spikes_and_the_pending_cancel_during_train(tmp_path: Path,
                                                                                      size: tuple[int, int]) -> None:
    from gputravel.console.tui.app import make_app
    from gputravel.console.tui.screens.training import TrainingScreen
    from gputravel.core.recording import Recorder

    rec = Recorder(tmp_path / "recording.db", meta={"settings": {"holders": 1}})
    t = 1000.0
    for event in (ev.RunStarted(t, "r1", {"kind": "emulated"}, ("alice",), 1),
                  ev.PhaseStarted(t + 1, 0, "alice", "TRAIN", 1),
                  ev.TrainingProgressed(t + 2, 0, "alice", 3, 8, 4.5, 1234.0, 3, (5.5, 5.0, 4.5)),
                  ev.LossSpiked(t + 3, 0, "alice", 5, 12.0, 4.4, 1.75),
                  ev.TrainingProgressed(t + 3, 0, "alice", 5, 8, 12.0, 1200.0, 5, (4.3, 12.0)),
                  ev.ControlRequested(t + 4, "cancel", "TRAIN")):
        rec(event)
    rec.close()
    app = make_app(replay=load_recording(tmp_path / "recording.db"))
    async with app.run_test(size=size) as pilot:
        await pilot.press("3", "end")
        for _ in range(200):
            if isinstance(app.screen, TrainingScreen) and app.bridge.state.pending == "cancel":
                break
            await pilot.pause(0.05)
        await pilot.pause()
        state = app.bridge.state
        assert state.loss == [(1, 5.5), (2, 5.0), (3, 4.5), (4, 4.3), (5, 12.0)]
        assert state.train_progress == (5, 8) and state.spikes == [(5, 12.0, 4.4)]
        text = _screen_text(app, size)
        toasts = [n.message for n in app._notifications]
    assert "no training steps yet" not in text
    assert "step 5/8" in text and "CANCELLING..." in text and "loss spikes: 1" in text
    assert any(m.startswith("loss spike: visit 1 alice, step 5: 12.000 > 1.75 x running mean") for m in toasts)


def test_sigterm_mid_train_lands_within_a_slice_scrubs_and_records_the_cancelled_visit(data_root: Path,
                                                                                     tmp_path: Path) -> None:
    """``gputravel runs stop`` sends SIGTERM: with 100 000 steps per visit the run still ends after the slice
    in flight (default slicing: 0.25 s of steps), the visit's buffer scrubbed, its ledger row and event say so."""
    import os
    import signal
    import subprocess
    import time

    from gputravel.core.errors import RecordingError

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(data_root),
                             "--holders", "2", "--rounds", "1", "--steps-per-visit", "100000", "--batch-size", "4",
                             "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out),
                             "--transport", "local"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        for _ in range(1200):  # until TRAIN has reported progress
            with contextlib.suppress(RecordingError):
                if (out / "recording.db").exists() and any(isinstance(e, ev.TrainingProgressed)
                                                           for e in load_recording(out / "recording.db").events()):
                    break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err  # CancelledRunError's exit code
    events = load_recording(out / "recording.db").events()
    (asked,) = [e for e in events if isinstance(e, ev.ControlRequested)]  # the pending CANCELLING... state
    (cancelled,) = [e for e in events if isinstance(e, ev.VisitCancelled)]
    assert asked.action == "cancel" and events.index(asked) < events.index(cancelled)
    assert cancelled.phase == "TRAIN" and cancelled.scrub_verified is True
    assert 0 < cancelled.steps < 100_000
    row, = rows_of(out, "visit-cancelled")
    assert row.detail["steps"] == cancelled.steps and row.detail["scrub_verified"] is True
    assert rows_of(out, "run-failed")[-1].outcome == "cancelled"
    assert verify_ledger(out / "ledger.db").ok


def test_view_model_shows_the_pending_control_until_it_lands_and_a_cancelled_visits_scrub() -> None:
    from gputravel.console.tui.screens.base import summarise
    from gputravel.console.view.model import RunState

    state = RunState()
    t = 1000.0
    for event in (ev.RunStarted(t, "r1", {"kind": "emulated"}, ("alice",), 1),
                  ev.PhaseStarted(t, 0, "alice", "TRAIN", 1),
                  ev.TrainingProgressed(t, 0, "alice", 4, 12, 4.0, 900.0, 4, (5.0, 4.8, 4.5, 4.0)),
                  ev.ControlRequested(t, "pause", "TRAIN")):
        state.apply(event)
    assert summarise(state, "training", ()).status == "pausing..."
    assert summarise(state, "training", ()).phase == "TRAIN 4/12"
    state.apply(ev.RunPaused(t, "paused", "TRAIN", "TRAIN 4/12"))
    assert state.pending is None and summarise(state, "training", ()).status == "paused in TRAIN 4/12"
    state.apply(ev.RunResumed(t))
    state.apply(ev.ControlRequested(t, "cancel", "TRAIN"))
    assert summarise(state, "training", ()).status == "cancelling..."
    state.apply(ev.VisitCancelled(t, 0, "alice", 1, "TRAIN", 4, True))
    state.apply(ev.RunFailed(t, "r1", "cancelled by the operator", "cancelled"))
    visit = state.visit(0)
    assert visit is not None and (visit.outcome, visit.scrub_verified) == ("cancelled", True)
    assert state.pending is None and summarise(state, "training", ()).status == "cancelled"
