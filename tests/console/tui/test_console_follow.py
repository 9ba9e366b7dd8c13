"""Follow as a view, not a control (issue 25.1): a read-only follow pauses, seeks and comes back to the live end,
and its status is the recording's newest, never the paused view's.

A "live" recording is written here with the real :class:`Recorder`: the first part of the synthetic run of
``test_console_snapshots``, then (while the console follows it, paused) the rest, final event included.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.replay_bridge import ReplayBridge
from gputravel.core.recording import RecordedItem, Recorder, load_recording
from tests.console.tui.test_console_snapshots import SIZE, screen_text, synthetic_run


def copy_items(rec: Recorder, items: tuple[RecordedItem, ...]) -> None:
    for item in items:
        if item.kind == "event":
            rec(item.event())
        else:
            rec.record_telemetry(item.frame())


def live_recording(tmp_path: Path) -> tuple[Recorder, tuple[RecordedItem, ...]]:
    """A recording being written: the first visit and a half so far; returns the recorder and the rest."""
    items = load_recording(synthetic_run(tmp_path / "whole.db")).items
    cut = next(i for i, item in enumerate(items) if item.name == "PhaseStarted" and item.body.get("visit") == 1) + 3
    rec = Recorder(tmp_path / "recording.db", meta={"source": "gputravel run"})
    copy_items(rec, items[:cut])
    return rec, items[cut:]


async def until(pilot: object, check: object, tries: int = 200) -> bool:
    for _ in range(tries):
        await pilot.pause(0.02)  # type: ignore[attr-defined]
        if check():  # type: ignore[operator]
            return True
    return False


def at_end(bridge: ReplayBridge) -> bool:
    return bridge.playback.player.position >= len(bridge.playback.player.items)


def status_line(app: GpuTravelConsole) -> str:
    return screen_text(app).splitlines()[0]


async def test_readonly_follow_paused_by_bracket_comes_back_with_end_and_says_completed(tmp_path: Path) -> None:
    rec, rest = live_recording(tmp_path)
    app = make_app(replay=tmp_path / "recording.db", readonly=True, follow=True)
    async with app.run_test(size=SIZE) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, ReplayBridge)
        bridge.playback.speed = 1000.0
        assert await until(pilot, lambda: at_end(bridge) and bridge.state.current_visit == 1)
        await pilot.press("left_square_bracket")  # back to the start of visit 2: the view pauses there
        await pilot.pause()
        assert not bridge.playback.playing and bridge.state.current_visit == 1
        copy_items(rec, rest)  # the run goes on and ends while the view is paused
        rec.close()
        assert await until(pilot, lambda: "COMPLETED" in status_line(app))  # the recording's final event
        assert bridge.state.status == "running"  # ... while the view still shows visit 2
        assert "FOLLOW ‖" in status_line(app)
        await pilot.press("end")  # End: the live end, followed again
        assert await until(pilot, lambda: bridge.state.status == "completed")
        assert bridge.playback.playing and at_end(bridge)
        assert "FOLLOW ▶" in status_line(app) and "RUNNING" not in status_line(app)


async def test_readonly_follow_resumes_with_p_space_and_right_bracket(tmp_path: Path) -> None:
    rec, rest = live_recording(tmp_path)
    app = make_app(replay=tmp_path / "recording.db", readonly=True, follow=True)
    async with app.run_test(size=SIZE) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, ReplayBridge)
        bridge.playback.speed = 1000.0
        assert await until(pilot, lambda: at_end(bridge))
        for resume in ("p", "right_square_bracket", "space"):
            await pilot.press("left_square_bracket", "left_square_bracket")
            await pilot.pause()
            assert not bridge.playback.playing
            seen = bridge.playback.player.position
            await pilot.press(resume)
            if resume == "p":  # play: on to the live end
                assert await until(pilot, lambda: at_end(bridge))
            else:  # one visit / one phase on, never refused in read-only
                await pilot.pause()
                assert bridge.playback.player.position > seen
        await pilot.press("right_square_bracket", "right_square_bracket", "right_square_bracket")
        assert await until(pilot, lambda: at_end(bridge) and bridge.playback.playing)  # past the last visit: followed
        copy_items(rec, rest)
        rec.close()
        assert await until(pilot, lambda: bridge.state.status == "completed")  # followed to the real end


async def test_readonly_replay_footer_offers_only_keys_that_work(tmp_path: Path) -> None:
    app = make_app(replay=load_recording(synthetic_run(tmp_path / "r.db")), readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        footer = screen_text(app).splitlines()[-1]
        assert "Cancel" not in footer and "Break" not in footer
        await pilot.press("space")  # steps the view: allowed, nothing is steered
        await pilot.pause()
        assert app.bridge.state.phases_completed == 1
        app.execute_command("cancel")
        await pilot.pause()
        assert any("read-only" in n.message or "no run to cancel" in n.message for n in app._notifications)


async def test_a_fleet_being_started_shows_its_gpus_before_any_rank_has_written(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    out.mkdir()
    app = make_app(replay=out, readonly=True, follow=True, gpus=2)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "STARTING" in text.splitlines()[0] and "FLEET ×2" in text
        assert "◆0" in text and "◆1" in text  # both GPUs on the route, at the orchestrator


def test_watch_fleet_opens_the_screen_before_the_fleet_writes_anything(tmp_path: Path, monkeypatch) -> None:
    import threading

    from gputravel.console.tui.fleet_console import watch_fleet
    from gputravel.core.config import RunSettings

    gate = threading.Event()
    monkeypatch.setattr("gputravel.core.fleet.run.launch_fleet",
                        lambda settings, options, entry, quiet: gate.wait(5) and {"fleet": {}})
    opened: list[dict[str, object]] = []

    class _App:
        is_running = False

        def __init__(self, **kw: object) -> None:
            opened.append(kw)

        def run(self) -> None:
            opened.append({"ranks": sorted(p.name for p in (tmp_path / "f").glob("rank-*"))})
            gate.set()

    watch_fleet(RunSettings(out_dir=tmp_path / "f"), gpus=2, make_app=_App, theme="dark")
    assert opened[0]["gpus"] == 2 and opened[0]["follow"] is True and opened[0]["readonly"] is True
    assert opened[1] == {"ranks": []}  # the screen was up before the fleet had started a rank


async def test_a_fleet_summary_at_80_columns_shows_every_gpu_line_whole(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rank-{rank}").mkdir()
        synthetic_run(tmp_path / f"rank-{rank}" / "recording.db")
    app = make_app(replay=tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("end")
        await pilot.pause()
        panel = [line.split("│", 1)[1] for line in screen_text(app).splitlines()[1:6] if "│" in line]
        gpu_lines = [line for line in panel if line.strip().startswith("GPU")]
        assert len(gpu_lines) == 2 and all("…" not in line and "✓" in line for line in gpu_lines), panel
        receipts = next(line for line in panel if "receipts" in line)
        assert "scr" in receipts and not receipts.rstrip().endswith("…"), panel


async def test_a_follow_opens_at_the_live_end_not_at_the_start_of_the_run(tmp_path: Path) -> None:
    """Following a run already under way shows where it is now (like ``tail -f``), not its history replayed
    at 8x from the first event (a long run took minutes to catch up); Home goes back to the start."""
    items = load_recording(synthetic_run(tmp_path / "whole.db")).items
    cut = next(i for i, item in enumerate(items) if item.name == "PhaseStarted" and item.body.get("visit") == 1) + 3
    rec = Recorder(tmp_path / "recording.db", meta={"source": "gputravel run"})
    for n, item in enumerate(x for x in items[:cut] if x.kind == "event"):  # a second apart: 8x paces them
        rec(dataclasses.replace(item.event(), t=1_000.0 + n))
    rec.close()
    app = make_app(replay=tmp_path / "recording.db", readonly=True, follow=True)
    async with app.run_test(size=SIZE) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, ReplayBridge)
        await pilot.pause()
        assert at_end(bridge) and bridge.playback.playing  # the default pace (8x) never got the chance to matter
        assert bridge.state.current_visit == 1 and "FOLLOW ▶" in status_line(app)
        await pilot.press("home")
        await pilot.pause()
        assert bridge.playback.player.position == 0 and bridge.state.current_visit is None


async def test_at_80_columns_the_status_bar_keeps_the_replay_position_whole() -> None:
    """80x24 in TRAIN of a replay: the epoch (and then the visit) make room, the REPLAY 466/752 badge is
    never cut (the travel panel shows the epoch and the visit)."""
    from textual.app import App, ComposeResult

    from gputravel.console.tui.widgets.status_bar import StatusBar, StatusSummary

    class Bar(App[None]):
        def compose(self) -> ComposeResult:
            yield StatusBar()

    app = Bar()
    async with app.run_test(size=(80, 24)) as pilot:
        bar = app.query_one(StatusBar)
        bar.summary = StatusSummary("travel", "completed", run_id="97b3321fdc59", where="orchestrator",
                                    phase="TRAIN 99/300", epoch=3, visit="visit 3/3 holder-2-histories",
                                    badges=("SIM", "REPLAY ‖ 466/752"))
        await pilot.pause()
        line = bar.render().plain  # type: ignore[union-attr]
        assert line.endswith("REPLAY ‖ 466/752 ") and len(line) <= bar.content_size.width
        assert "TRAIN 99/300" in line and "3/3" in line and "ep 3" not in line
