"""Snapshot tests: every console screen rendering a recorded run, as text, against golden files.

The recording is synthetic and fixed (event times, fingerprints, losses, a ledger with fixed
timestamps), so a screen renders the same on every machine; no wall-clock value reaches a snapshot.
Regenerate the goldens after an intended change with ``GPUTRAVEL_UPDATE_SNAPSHOTS=1 pytest tests/console/tui/test_console_snapshots.py``
and review the diff.
"""

from __future__ import annotations

import io
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import SNAPSHOTS_DIR
from rich.console import Console

from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.screens.ledger import LedgerScreen
from gputravel.core import events as ev
from gputravel.core.ledger import Ledger
from gputravel.core.phases import VISIT_PHASES
from gputravel.core.recording import Recorder, load_recording
from gputravel.core.telemetry import CCState, GpuSample, NvmlStatus, TelemetryFrame

SNAPSHOTS = SNAPSHOTS_DIR / "console"
UPDATE = os.environ.get("GPUTRAVEL_UPDATE_SNAPSHOTS") == "1"
SIZE = (120, 40)
NO_NVML = NvmlStatus(available=False, reason="NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on "
                                             "this machine")


def synthetic_run(path: Path, *, ledger: Path | None = None) -> Path:
    """Three visits: alice done, bob done after one rejected chunk, carol failed (agent died in PROVISION)."""
    rec = Recorder(path, meta={"settings": {"holders": 3}, "ledger": str(ledger) if ledger else None})
    t = [1000.0]

    def at(dt: float = 0.05) -> float:
        t[0] = round(t[0] + dt, 3)
        return t[0]

    def frame(phase: str | None, rx: float, util: float, mem: int) -> None:
        rec.record_telemetry(TelemetryFrame(t=at(0.01), source="emulated", nvml=NO_NVML, phase=phase, devices=(
            GpuSample(index=0, name="CPU (emulated GPU memory)", uuid="emu-gpu-0", sim=True, util_gpu=util,
                      mem_used=mem, pcie_rx_bps=rx, cc=CCState(feature="on", environment="sim",
                                                               protected_mem_kib=256),
                      note="emulated on cpu"),)))

    rec(ev.DeviceAttested(at(), "emu-gpu-0", True, {"nonce": True, "chain": True}, True))
    names = ("alice", "bob", "carol")
    for i, name in enumerate(names):
        rec(ev.HolderConnected(at(), name, "byte", 40_000 + i * 1000, 4_000, f"{'ab' * 4}{i}" + "0" * 55))
    rec(ev.RunStarted(at(), "snap0001", {"kind": "emulated", "sim": True, "device": "cpu", "notes": []}, names, 3))
    step = 0
    loss = 5.6
    for visit, name in enumerate(names):
        epoch = visit + 1
        fp = f"{visit + 1:x}" * 16
        for phase in VISIT_PHASES:
            p = str(phase)
            rec(ev.PhaseStarted(at(), visit, name, p, epoch))
            detail: dict[str, object] = {}
            nbytes = 0
            if p == "PROVISION":
                for k in range(1, 4):
                    rec(ev.ProvisionProgressed(at(), visit, name, epoch, k * 16384, 49152))
                    frame(f"{name} · PROVISION", 40e6 + visit * 10e6 + k * 5e6, 35.0, 2_000_000)
                if name == "bob":
                    rec(ev.ChunkRejected(at(), visit, name, epoch, 1, "tag", "authentication tag mismatch"))
                if name == "carol":
                    rec(ev.VisitFailed(at(), visit, name, epoch, "PROVISION", "agent carol: the agent closed the "
                                       "link (died or was stopped)", "agent"))
                    break
                detail, nbytes = {"mb_s": 48.5 + visit, "retransmits": 1 if name == "bob" else 0}, 49152
            elif p == "HANDOFF":
                detail = {"window": [0, 49152], "part": f"{name}/0"}
            elif p == "RETURN":
                detail, nbytes = {"chunks": 3}, 49152
            elif p == "TRAIN":
                losses = tuple(round(loss - 0.1 * k, 3) for k in range(4))
                step += len(losses)
                loss = losses[-1] - 0.05
                frame(f"{name} · TRAIN", 0.0, 90.0, 2_100_000)
                rec(ev.TrainingStepped(at(), visit, name, step, losses, round(losses[-1] + 0.2, 3), 6500.0))
                detail = {"loss_first": losses[0], "loss_last": losses[-1], "val_loss": losses[-1] + 0.2,
                          "steps": 4}
            elif p == "SCRUB":
                nbytes = 262144
            fpc = fp if p in ("HANDOFF", "PROVISION", "RETURN") else None
            rec(ev.PhaseCompleted(at(), visit, name, p, epoch, 0.25, "ok", nbytes, fpc, detail))
            if p == "ROTATE":
                rec(ev.KeyRotated(at(), epoch, fp))
        else:
            rec(ev.VisitCompleted(at(), visit, name, epoch, ev.VisitSummary(integrity_ok=True, scrub_verified=True)))
    rec(ev.RunCompleted(at(), "snap0001", 3, 1, 4.5))
    rec.close()
    return path


def synthetic_ledger(path: Path) -> Path:
    with Ledger.open(path, run_id="snap0001") as ledger:
        ledger.append(kind="attested", phase="SETUP", ts=1000.0, detail={"device_id": "emu-gpu-0"})
        for i, name in enumerate(("alice", "bob", "carol")):
            for j, phase in enumerate(("ATTEST", "HANDOFF", "PROVISION")):
                ledger.append(kind="phase", phase=phase, holder=name, epoch=i + 1, ts=1001.0 + i * 10 + j,
                              key_fp=f"{i + 1:x}" * 16 if phase != "ATTEST" else None,
                              nbytes=49152 if phase == "PROVISION" else 0, duration_s=0.25, detail={"visit": i})
    return path


def screen_text(app: GpuTravelConsole, *, mask: dict[str, str] | None = None) -> str:
    """The current screen as plain text (what Textual's SVG export draws, minus colour)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system=None, legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    text = "\n".join(line.rstrip() for line in console.export_text().splitlines())
    for old, new in (mask or {}).items():
        text = text.replace(old, new)
    return text + "\n"


def check_snapshot(name: str, text: str) -> None:
    golden = SNAPSHOTS / f"{name}.txt"
    if UPDATE or not golden.exists():
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
        if not UPDATE:
            pytest.fail(f"wrote a new snapshot {golden}; review it and run again")
    assert text == golden.read_text(), f"{name} differs from {golden} (GPUTRAVEL_UPDATE_SNAPSHOTS=1 rewrites it)"


@pytest.fixture()
def recording() -> Iterator[Path]:
    """The synthetic run in a folder whose path has the same length on every run: the ledger screen shows the
    path (masked as ``<tmp>`` only after the screen wrapped it), and ``tmp_path`` is longer under pytest-xdist's
    workers (``popen-gw0/``) and with pytest's run counter, which moved the wrap."""
    folder = Path(tempfile.mkdtemp(prefix="gt-snap-"))
    try:
        ledger = synthetic_ledger(folder / "ledger.db")
        yield synthetic_run(folder / "recording.db", ledger=ledger)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def wait_workers(app: GpuTravelConsole, *groups: str) -> None:
    """Wait for the workers of ``groups`` (never for the replay loop, which runs as long as the app)."""
    for worker in list(app.workers):
        if worker.group in groups:
            await worker.wait()


async def settle(pilot: object, app: GpuTravelConsole) -> None:
    for _ in range(3):
        await pilot.pause()  # type: ignore[attr-defined]
    await wait_workers(app, "ledger-load", "ledger-verify")
    app.clear_notifications()
    await pilot.pause()  # type: ignore[attr-defined]


# ids "<name>-screen": a bare "gpu" id is a keyword conftest reads as @pytest.mark.gpu (needs CUDA) and skips
@pytest.mark.parametrize("screen", ["travel", "holders", "training", "gpu", "bench", "ledger", "help"],
                         ids=lambda s: f"{s}-screen")
async def test_screen_renders_the_recorded_run_as_the_snapshot(recording: Path, screen: str) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("end")
        if screen == "help":  # the help overlay over the travel screen
            await pilot.press("question_mark")
        else:
            await pilot.press(str(("travel", "holders", "training", "gpu", "bench", "ledger").index(screen) + 1))
        await settle(pilot, app)
        if screen == "ledger":
            assert isinstance(app.screen, LedgerScreen)
            await settle(pilot, app)
        check_snapshot(screen, screen_text(app, mask={str(recording.parent): "<tmp>"}))


async def test_replay_space_steps_exactly_one_phase_and_jumps_by_visit(recording: Path) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=SIZE) as pilot:
        assert app.bridge.state.phases_completed == 0
        await pilot.press("space")  # set-up events, then ATTEST of visit 1
        await pilot.pause()
        assert app.bridge.state.phases_completed == 1
        assert app.bridge.state.last_phase == "ATTEST"
        await pilot.press("space")
        await pilot.pause()
        assert (app.bridge.state.phases_completed, app.bridge.state.last_phase) == (2, "HANDOFF")
        assert "GPU ◆ alice" in screen_text(app)
        await pilot.press("right_square_bracket")  # to the start of visit 2: its ATTEST has begun
        await pilot.pause()
        state = app.bridge.state
        assert [v.outcome for v in state.visits.values()] == ["done", "running"]
        assert state.current_holder == "bob" and state.current_visit == 1 and state.phases_completed == 8
        assert "visit 2/3 bob" in screen_text(app)  # the header names the visit jumped to
        await pilot.press("space")
        await pilot.pause()
        assert app.bridge.state.current_visit == 1 and app.bridge.state.last_phase == "ATTEST"
        await pilot.press("home")
        await pilot.pause()
        assert app.bridge.state.events_seen == 0


async def test_replay_brackets_walk_visit_by_visit_both_ways(recording: Path) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=SIZE) as pilot:
        seen = []
        for _ in range(3):
            await pilot.press("right_square_bracket")
            await pilot.pause()
            seen.append((app.bridge.state.current_visit, app.bridge.state.current_holder))
        assert seen == [(0, "alice"), (1, "bob"), (2, "carol")]  # ] never sticks on a visit
        await pilot.press("right_square_bracket")  # past the last visit: the end
        await pilot.pause()
        assert app.bridge.state.status == "completed"
        for want in ("carol", "bob", "alice", "alice"):
            await pilot.press("left_square_bracket")
            await pilot.pause()
            assert app.bridge.state.current_holder == want
        text = screen_text(app)
        assert "visit 1/3 alice" in text


async def test_replay_refuses_cancel_and_break_quietly(recording: Path) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c", "b")
        await pilot.pause()
        assert not app._notifications  # no toast about scrubbing a buffer that a recording does not have
        assert "Cancel" not in screen_text(app).splitlines()[-1]
        app.execute_command("cancel")
        await pilot.pause()
        assert any("a replay has no run to cancel" in n.message for n in app._notifications)


async def test_replay_jump_command_and_playback_reach_the_end(recording: Path) -> None:
    app = make_app(replay=load_recording(recording))
    assert app.bridge.playback is not None
    app.bridge.playback.speed = 1000.0
    async with app.run_test(size=SIZE) as pilot:
        app.execute_command("jump 3")
        await pilot.pause()
        assert [v.visit for v in app.bridge.state.visits.values()] == [0, 1, 2]
        assert "visit 3/3 carol" in screen_text(app)  # the header shows the visit jumped to, not the one before
        await pilot.press("p")  # play
        for _ in range(200):
            await pilot.pause(0.02)
            if app.bridge.state.status == "completed":
                break
        assert app.bridge.state.status == "completed"
        assert app.bridge.state.holders["carol"].state == "failed"
        assert "REPLAY" in screen_text(app)


async def test_readonly_replay_hides_the_controls_but_not_the_view_keys(recording: Path) -> None:
    app = make_app(replay=load_recording(recording), readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c", "b")
        await pilot.pause()
        assert app.bridge.state.events_seen == 0 and not app._notifications  # nothing to steer
        await pilot.press("space")  # stepping a recording moves the view only: allowed to an observer
        await pilot.pause()
        assert app.bridge.state.phases_completed == 1
        text = screen_text(app)
        assert "READ-ONLY" in text and "Cancel" not in text.splitlines()[-1]


async def test_ledger_screen_names_the_row_that_breaks_the_chain(tmp_path: Path) -> None:
    ledger = synthetic_ledger(tmp_path / "ledger.db")
    db = sqlite3.connect(ledger)
    db.execute("UPDATE events SET holder = 'mallory' WHERE seq = 5")
    db.commit()
    db.close()
    app = make_app(replay=load_recording(synthetic_run(tmp_path / "rec.db", ledger=ledger)))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("6")
        await settle(pilot, app)
        screen = app.screen
        assert isinstance(screen, LedgerScreen)
        await pilot.press("v")
        await pilot.pause()
        await wait_workers(app, "ledger-verify")
        await pilot.pause()
        assert screen.result is not None and screen.result.first_bad_seq == 5
        text = screen_text(app)
        assert "BROKEN at row 5" in text and "row 5 breaks the chain" in text


@pytest.mark.parametrize("screen", ["travel", "holders", "gpu"], ids=lambda s: f"{s}-screen")
async def test_small_terminal_80x24_renders_the_compact_layout_as_the_snapshot(recording: Path, screen: str) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("end")
        await pilot.press(str(("travel", "holders", "training", "gpu").index(screen) + 1))
        await settle(pilot, app)
        text = screen_text(app, mask={str(recording.parent): "<tmp>"})
        lines = text.splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        assert "? Help" in lines[-1] and "q Quit" in lines[-1]  # the footer drops other keys first
        assert "REPLAY ‖ 71/71" in lines[0]  # the status bar's badges are never cut
        if screen == "travel":  # the timeline is on screen, every visit, and no detail line is broken in two
            assert sum(1 for line in lines if line.lstrip().startswith(("1 ", "2 ", "3 "))) == 3
            assert "devic\n" not in text
        check_snapshot(f"{screen}-80x24", text)


def failed_run(path: Path) -> Path:
    """A run whose device died in PROVISION: the engine's RunFailed, then the agents stop."""
    rec = Recorder(path, meta={"settings": {"holders": 1}})
    rec(ev.RunStarted(1.0, "dead0001", {"kind": "emulated", "sim": True}, ("alice",), 1))
    for i, phase in enumerate(("ATTEST", "HANDOFF", "PROVISION")):
        rec(ev.PhaseStarted(2.0 + i, 0, "alice", phase, 1))
        if phase != "PROVISION":
            rec(ev.PhaseCompleted(2.5 + i, 0, "alice", phase, 1, 0.5, "ok", 0, "ab" * 8 if i else None))
    rec(ev.RunFailed(6.0, "dead0001", "DeviceError: the device service died: broken pipe", "device"))
    rec(ev.HolderStateChanged(6.1, "alice", "stopped", ""))
    rec.close()
    return path


async def test_a_replayed_failed_run_ends_failed_not_running(tmp_path: Path) -> None:
    app = make_app(replay=load_recording(failed_run(tmp_path / "dead.db")))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("end")
        await pilot.pause()
        state = app.bridge.state
        assert state.status == "failed" and state.gpu_at == "orchestrator"
        assert state.visit(0) is not None and state.visit(0).outcome == "failed"  # type: ignore[union-attr]
        text = screen_text(app)
        assert "FAILED" in text and "run failed (device)" in text and "RUNNING" not in text


async def test_help_at_80x24_wraps_a_long_line_under_its_description_not_to_column_0(recording: Path) -> None:
    app = make_app(replay=load_recording(recording))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await settle(pilot, app)
        app.screen.query_one("#help-box").scroll_to(y=12, animate=False)
        await settle(pilot, app)
        lines = screen_text(app).splitlines()
        first = next(i for i, line in enumerate(lines) if "f12" in line)
        key_col = lines[first].index("f12")
        text_col = lines[first].index("save")
        assert text_col > key_col + 3
        more = lines[first + 1]  # the description's second line starts under its first, not under the key
        assert more[key_col:text_col].strip() == "" and more[text_col:text_col + 1].strip(), (lines[first], more)
        check_snapshot("help-80x24", "\n".join(lines) + "\n")
