"""The console as an operator uses it: keys pressed in a Pilot, the engine's state and the screen checked.

Live tests run the real engine on tiny data (two holders of ~60 KB, 16 KiB chunks, a 0.25 MiB buffer,
2 steps per visit), so each run takes a few seconds on a 2-core machine.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData, small_settings, until
from rich.console import Console

from gputravel.console.entries import ENTRIES
from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.live_bridge import LiveBridge
from gputravel.console.tui.screens.bench import BenchScreen
from gputravel.console.tui.screens.gpu import GpuScreen
from gputravel.console.tui.screens.help import HelpScreen
from gputravel.console.tui.screens.holders import HoldersScreen
from gputravel.console.tui.widgets.gpu_card import GpuCard
from gputravel.core import events as ev
from gputravel.core.api import build_engine, resolve_holder_dirs
from gputravel.core.ledger import verify_ledger
from gputravel.core.phases import Phase
from gputravel.core.recording import Recorder, load_recording
from gputravel.core.telemetry import CCState, GpuSample, NvmlStatus, TelemetryFrame
from gputravel.core.travel.local_link import LocalHolderLink

SIZE = (120, 40)


@pytest.fixture(scope="module")
def data_root(holder_data: HolderData) -> Path:
    return holder_data({"alice": 0, "bob": 1}, n_words=13_000, name="holders")


def factory_for(data_root: Path, tmp_path: Path, *, tweak: Callable[[dict[str, LocalHolderLink]], None] | None = None
                ) -> Callable[[], Any]:
    runs = iter(range(100))

    def factory() -> Any:
        settings = small_settings(data_root, tmp_path / f"run-{next(runs)}",
                                  # a tweak's link hooks (kill after N chunks) count chunks in the link's relay
                                  data_path="direct" if tweak is None else "channel")
        links = {name: LocalHolderLink(name, path, agent=ENTRIES.holder_agent, val_fraction=settings.val_fraction)
                 for name, path in resolve_holder_dirs(settings)}
        if tweak is not None:
            tweak(links)
        return build_engine(settings, links=list(links.values()))

    return factory


def screen_text(app: GpuTravelConsole) -> str:
    console = Console(width=SIZE[0], height=SIZE[1], file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def sim_cards(app: GpuTravelConsole) -> list[GpuCard]:
    """The GPU screen's cards of emulated devices (whatever NVML cards the machine adds)."""
    return [c for c in app.screen.query(GpuCard) if c.snapshot is not None and c.snapshot.sim]


def live(app: GpuTravelConsole) -> LiveBridge:
    assert isinstance(app.bridge, LiveBridge)
    return app.bridge


async def test_break_before_handoff_then_run_stops_before_handoff_and_cancel_ends_it(
        data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), telemetry_interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("b")  # before the engine exists: kept and applied when it is built
        assert live(app).state.breakpoints == {"HANDOFF"}
        await pilot.press("r")
        bridge = live(app)
        await until(pilot, lambda: bridge.session.paused_at() == "HANDOFF" and bridge.state.paused_before == "HANDOFF",
                    what="pause before HANDOFF")
        engine = bridge.session.engine
        assert engine is not None and Phase.HANDOFF in engine.control.breakpoints
        assert bridge.state.phases_completed == 1 and bridge.state.last_phase == "ATTEST"
        await pilot.pause(0.3)  # still paused: nothing moves on its own
        assert bridge.state.phases_completed == 1
        text = screen_text(app)
        assert "PAUSED BEFORE HANDOFF" in text and "paused before HANDOFF (breakpoint)" in text and "‖" in text
        await pilot.press("c", "y")  # c asks first; y confirms
        await until(pilot, lambda: bridge.state.status == "cancelled" and not app.run_in_flight, what="cancelled")
        assert bridge.session.finished and not engine.device.handle.alive()
        assert "CANCELLED" in screen_text(app)


async def test_space_steps_one_phase_at_a_time_through_a_visit_and_q_quits(data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), telemetry_interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        await pilot.press("space")  # starts the run paused; ATTEST runs
        # the engine pauses before its ATTEST's event reaches the view: wait for both
        await until(pilot, lambda: bridge.session.paused_at() == "HANDOFF" and bridge.state.phases_completed >= 1,
                    what="first step")
        assert bridge.state.phases_completed == 1
        order = ["PROVISION", "RETURN", "VERIFY", "TRAIN", "SCRUB", "ROTATE", "ATTEST"]
        for n, nxt in enumerate(order, start=2):
            await pilot.press("space")
            await until(pilot, lambda nxt=nxt, n=n: bridge.session.paused_at() == nxt  # type: ignore[misc]
                        and bridge.state.phases_completed == n, what=f"step to {nxt}")
            assert bridge.state.phases_completed == n  # exactly one phase per space
            if nxt == "RETURN":
                assert "GPU ◆ alice" in screen_text(app)
        visit = bridge.state.visit(0)
        assert visit is not None
        assert visit.outcome == "done" and visit.integrity_ok and visit.scrub_verified
        text = screen_text(app)
        assert "done" in text and "receipts #1 alice: integrity ✓ scrub ✓" in text
        await pilot.press("4")
        # the run's emulated device has a SIM card, the first one, also where NVML adds the machine's GPUs
        await until(pilot, lambda: isinstance(app.screen, GpuScreen) and bool(sim_cards(app)), what="gpu")
        cards = list(app.screen.query(GpuCard))
        assert cards[0] is sim_cards(app)[0] and cards[0].snapshot is not None
        assert cards[0].snapshot.uuid == bridge.state.device_id
        text = screen_text(app)
        assert "SIM" in text  # the first card is the one on screen
        assert "NVML" in text and ("not available" in text or "available" in text)
        await pilot.press("3")
        await pilot.pause()
        assert "loss" in screen_text(app) and bridge.state.loss
        await pilot.press("p")  # resume: the rest of the run goes on its own
        await until(pilot, lambda: bridge.state.status == "completed", what="completion")
        out = bridge.session.out_dir
        assert out is not None and verify_ledger(Path(out) / "ledger.db").ok
        recording = load_recording(Path(out) / "recording.db")
        assert recording.events()[-1].kind == "RunCompleted"
        assert any(i.kind == "telemetry" for i in recording.items)
        await pilot.press("q")
    assert not bridge.session.engine.device.handle.alive()  # type: ignore[union-attr]


async def test_sim_card_comes_first_where_nvml_shows_the_machines_gpu_too(tmp_path: Path) -> None:
    """On a machine with a driver (an H100), NVML's card is sampled from the first tick and the run's SIM card
    only once its device is attested: the SIM card still goes first, visible in 80x24 too."""
    h100 = GpuSample(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-5a1b0000-0000-0000-0000-000000000000",
                     util_gpu=0.0, mem_used=600 * 2**20, mem_total=80 * 2**30, power_w=70.0, power_limit_w=700.0,
                     temp_c=31.0, cc=CCState(feature="off"))
    sim = GpuSample(index=0, name="CUDA (emulated GPU memory)", uuid="emu-gpu-0", sim=True, util_gpu=12.0,
                    cc=CCState(feature="on", environment="sim"))
    nvml = NvmlStatus(available=True, driver_version="550.54.15", device_count=1)
    rec = Recorder(tmp_path / "recording.db", meta={"settings": {"holders": 1}})
    rec.record_telemetry(TelemetryFrame(t=1000.0, source="nvml", nvml=nvml, devices=(h100,)))
    rec(ev.DeviceAttested(1000.5, "emu-gpu-0", True, {"chain": True}, True))
    rec.record_telemetry(TelemetryFrame(t=1001.0, source="nvml", nvml=nvml, devices=(h100, sim)))
    rec.close()
    for size in ((120, 40), (80, 24)):
        app = make_app(replay=load_recording(tmp_path / "recording.db"))
        async with app.run_test(size=size) as pilot:
            await pilot.press("4", "end")
            await until(pilot, lambda app=app: isinstance(app.screen, GpuScreen)  # type: ignore[misc]
                        and len(app.screen.query(GpuCard)) == 2, what="both cards")
            await pilot.pause()
            cards = list(app.screen.query(GpuCard))
            assert [c.snapshot.sim for c in cards if c.snapshot is not None] == [True, False]
            console = Console(width=size[0], height=size[1], file=io.StringIO(), record=True, color_system=None)
            console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
            text = console.export_text()
            assert "GPU 0 · CUDA (emulated GPU memory) · SIM" in text and "emu-gpu-0" in text


async def test_holder_table_shows_failed_after_an_agent_dies(data_root: Path, tmp_path: Path) -> None:
    def kill_alice(links: dict[str, LocalHolderLink]) -> None:
        links["alice"].session.kill_after_chunks = 1

    app = make_app(engine_factory=factory_for(data_root, tmp_path, tweak=kill_alice), telemetry_interval=0.5,
                   record=False)
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        await pilot.press("b", "r")  # hold the run before each hand-off, so the screen can be read
        await until(pilot, lambda: bridge.state.paused_before == "HANDOFF", what="first hand-off")
        await pilot.press("p")  # alice's agent dies while provisioning; the engine redoes the visit
        await until(pilot, lambda: bridge.state.paused_before == "HANDOFF" and len(bridge.state.visits) == 2,
                    what="the retry to reach its hand-off")
        first, retry = bridge.state.visits.values()
        assert (first.outcome, first.failed_phase, retry.attempt) == ("failed", "PROVISION", 2)
        alice = bridge.state.holders["alice"]
        # the agent died (failed), then was restarted for the retry (ready): both show in its log
        assert alice.visits_failed == 1 and alice.state == "ready"
        assert any("failed" in str(line) for line in alice.log)
        await pilot.press("2")
        await pilot.pause()
        assert isinstance(app.screen, HoldersScreen)
        row = next(line for line in screen_text(app).splitlines() if line.strip().startswith("alice"))
        assert "1" in row  # the failed-visit count
        await pilot.press("1")
        await pilot.pause()
        assert "failed (PROVISION)" in screen_text(app)
        await pilot.press("b", "p")
        await until(pilot, lambda: bridge.state.status == "completed", what="completion")
        done = bridge.state.visit(0)
        assert done is not None and done.outcome == "done" and done.attempt == 2
        assert bridge.state.holders["alice"].state == "stopped"  # agents are stopped when the run ends


def never_built() -> Any:
    raise AssertionError("the engine must not be built")


async def test_readonly_console_offers_no_controls() -> None:
    app = make_app(engine_factory=never_built, readonly=True, record=False)
    async with app.run_test(size=SIZE) as pilot:
        for key in ("r", "space", "b", "p", "c"):
            await pilot.press(key)
        await pilot.pause()
        assert not live(app).session.built and not live(app).state.breakpoints
        app.execute_command("run")
        await pilot.pause()
        assert not live(app).session.built
        footer = screen_text(app).splitlines()[-1]
        assert "Step" not in footer and "Run" not in footer and "READ-ONLY" in screen_text(app)


async def test_command_line_sets_breakpoints_switches_screens_and_themes() -> None:
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("colon")
        await pilot.press(*"break provision", "enter")
        await pilot.pause()
        assert live(app).state.breakpoints == {"PROVISION"}
        assert live(app).session.breakpoints == {Phase.PROVISION}
        await pilot.press("colon", *"holders", "enter")
        await pilot.pause()
        assert isinstance(app.screen, HoldersScreen)
        app.execute_command("theme high-contrast")
        assert app.theme == "gputravel-high-contrast"
        await pilot.press("question_mark")
        await until(pilot, lambda: "holders screen" in screen_text(app), timeout=5, what="help")
        assert isinstance(app.screen, HelpScreen)
        assert "holders screen" in screen_text(app) and ":break PHASE" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, HoldersScreen)


async def test_palette_lists_the_controls() -> None:
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=SIZE):
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("Run", "Step one phase", "Pause / resume", "Break before HANDOFF", "Cancel run",
                      "Screen: ledger", "Verify ledger", "Theme: light"):
            assert title in titles


async def test_bench_screen_runs_a_benchmark_in_a_worker_and_charts_it() -> None:
    async def fake_runner(name: str, on_line: Callable[[str], None]) -> Any:
        on_line("warming up")
        return {"bench": name, "results": [{"variant": "plain", "mb_s": 900.0}, {"variant": "secure", "mb_s": 300.0}]}

    app = make_app(engine_factory=never_built, record=False, bench_runner=fake_runner)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await pilot.pause()
        assert isinstance(app.screen, BenchScreen)
        await pilot.press("enter")
        for worker in list(app.workers):
            if worker.group == "bench":
                await worker.wait()
        await pilot.pause()
        text = screen_text(app)
        assert "done provision: 2 rows, bars: mb_s" in text
        assert "plain" in text and "secure" in text and "█" in text


# --- every way a run ends is shown ------------------------------------------------------------------------
async def test_a_run_whose_device_dies_is_shown_ended_and_its_recording_says_so(data_root: Path,
                                                                                  tmp_path: Path) -> None:
    from gputravel.core.ledger import read_rows

    base = factory_for(data_root, tmp_path)

    def factory() -> Any:
        engine = base()
        engine.device.restart_device = None  # no recovery: the device's death ends the run
        return engine

    app = make_app(engine_factory=factory, telemetry_interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        app.execute_command("break provision")
        await pilot.press("r")
        await until(pilot, lambda: bridge.state.paused_before == "PROVISION", what="pause before PROVISION")
        engine = bridge.session.engine
        assert engine is not None
        engine.device.handle.kill()  # the device dies while the holder holds its key
        await pilot.press("p")
        await until(pilot, lambda: bridge.state.status == "failed" and not app.run_in_flight, what="the end")
        text = screen_text(app)
        assert "FAILED" in text and "RUNNING" not in text
        assert "run failed (device)" in text
        await pilot.press("c")  # nothing to cancel: says so, changes nothing
        await pilot.pause()
        assert bridge.state.status == "failed" and not app.run_in_flight
        out = Path(bridge.session.out_dir)
    recording = load_recording(out / "recording.db")
    endings = [e.kind for e in recording.events() if e.kind in ("RunCompleted", "RunFailed")]
    assert endings == ["RunFailed"]  # then only the agents' "stopped"
    assert recording.meta["status"] == "failed" and "device" in recording.meta["error"]
    rows = read_rows(out / "ledger.db")
    ending = [r.kind for r in rows if r.kind.startswith("run-")]
    assert ending == ["run-failed"]  # the ledger's final run row says how it ended (agents' "stopped" follow)
    assert {r.kind for r in rows[rows.index(next(r for r in rows if r.kind == "run-failed")):]} <= {
        "run-failed", "holder-state"}
    handoffs = [r for r in rows if r.kind == "phase" and r.phase == "HANDOFF"]
    assert [r.holder for r in handoffs] == ["alice"]  # no key was handed to anyone after the device died


async def test_an_exception_the_engine_does_not_report_still_ends_the_run_on_screen_and_in_the_recording(
        data_root: Path, tmp_path: Path) -> None:
    def broken_start(links: dict[str, LocalHolderLink]) -> None:
        async def start() -> None:
            raise RuntimeError("the holder's host vanished")

        links["bob"].start = start  # type: ignore[method-assign]

    app = make_app(engine_factory=factory_for(data_root, tmp_path, tweak=broken_start), telemetry_interval=0.5)
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        await pilot.press("r")
        await until(pilot, lambda: not app.run_in_flight and bridge.state.status != "starting", what="the end")
        assert bridge.state.status == "failed" and bridge.state.error_code == "internal"
        assert "RuntimeError: the holder's host vanished" in (bridge.state.error or "")
        assert "FAILED" in screen_text(app)
        out = Path(bridge.session.out_dir)
        assert bridge.session.finished and not bridge.session.engine.device.handle.alive()  # type: ignore[union-attr]
    recording = load_recording(out / "recording.db")
    (last,) = [e for e in recording.events() if e.kind in ("RunCompleted", "RunFailed")]
    assert last.kind == "RunFailed" and last.code == "internal"  # type: ignore[attr-defined]
    assert recording.meta["status"] == "failed"


# --- the : line ----------------------------------------------------------------------------------------------
async def test_colon_run_step_pause_resume_break_and_cancel_drive_a_live_run(data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), telemetry_interval=0.5, record=False)
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)

        async def colon(command: str) -> None:
            await pilot.press("colon", *command, "enter")
            await pilot.pause()

        await colon("break handoff")
        await colon("run")
        await until(pilot, lambda: bridge.state.paused_before == "HANDOFF", what=":run to the breakpoint")
        await colon("step")
        await until(pilot, lambda: bridge.state.paused_before == "PROVISION" and bridge.state.last_phase == "HANDOFF",
                    what=":step one phase")  # the pause and the HANDOFF's event may reach the view in either order
        assert bridge.state.last_phase == "HANDOFF"
        await colon("break handoff")  # off again
        assert "HANDOFF" not in bridge.state.breakpoints
        done = bridge.state.phases_completed
        app.execute_command("resume")  # and at once pause: the engine runs one more phase, then waits
        app.execute_command("pause")
        await until(pilot, lambda: bridge.state.phases_completed > done and bridge.state.paused_before is not None,
                    what=":resume then :pause")
        assert bridge.state.status == "paused"
        await colon("cancel")
        await pilot.press("y")
        await until(pilot, lambda: bridge.state.status == "cancelled" and not app.run_in_flight, what=":cancel")


async def test_colon_help_verify_screens_theme_screenshot_unknown_and_quit(tmp_path: Path, monkeypatch) -> None:
    from gputravel.console.tui.screens.ledger import LedgerScreen

    monkeypatch.setenv("GPUTRAVEL_SCREENSHOT_DIR", str(tmp_path / "shots"))
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=SIZE) as pilot:
        async def colon(command: str) -> None:
            await pilot.press("colon", *command, "enter")
            await pilot.pause()

        await colon("help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await colon("verify")
        await pilot.pause()
        assert isinstance(app.screen, LedgerScreen)
        for name in ("travel", "holders", "training", "gpu", "bench", "ledger"):
            await colon(name)
            assert app.screen.SCREEN_NAME == name  # type: ignore[attr-defined]
        await colon("theme light")
        assert app.theme == "gputravel-light"
        await colon("theme plaid")
        assert app.theme == "gputravel-light" and any("plaid" in n.message for n in app._notifications)
        await colon("screenshot ledger-test")
        await until(pilot, lambda: (tmp_path / "shots" / "console-ledger-test.svg").exists(), timeout=5,
                    what="the screenshot")
        await until(pilot, lambda: any("screenshot saved to" in n.message for n in app._notifications),
                    timeout=5, what="where the screenshot went")
        await colon("frobnicate")
        assert any("unknown command 'frobnicate': :help lists" in n.message for n in app._notifications)
        await colon("q")
    assert app.return_code == 0 and not app.is_running


async def test_colon_quit_leaves_the_console() -> None:
    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("colon", *"quit", "enter")
        await pilot.pause()
    assert not app.is_running


async def test_the_command_line_shows_what_is_typed() -> None:
    from gputravel.console.tui.widgets.command_line import CommandLine

    app = make_app(engine_factory=never_built, record=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("colon", *"break provision")
        await pilot.pause()
        line = app.screen.query_one(CommandLine)
        assert line.has_focus and line.region.height == 1
        rows = screen_text(app).splitlines()
        assert any(row.strip() == "break provision" for row in rows[-3:]), rows[-3:]  # above the footer, readable


async def test_readonly_console_starts_no_benchmark() -> None:
    calls: list[str] = []

    async def runner(name: str, on_line: Callable[[str], None]) -> Any:
        calls.append(name)
        return []

    app = make_app(engine_factory=never_built, readonly=True, record=False, bench_runner=runner)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await pilot.pause()
        await pilot.press("enter")
        app.execute_command("bench provision")
        await pilot.pause()
        assert calls == [] and "read-only console" in screen_text(app)


async def test_slash_filters_the_holders_table_and_escape_clears_it(data_root: Path, tmp_path: Path) -> None:
    app = make_app(engine_factory=factory_for(data_root, tmp_path), telemetry_interval=0.5, record=False,
                   breakpoints=("ATTEST",))
    async with app.run_test(size=SIZE) as pilot:
        bridge = live(app)
        assert bridge.state.breakpoints == {"ATTEST"}  # --break-before shows before the run starts
        await pilot.press("r")
        await until(pilot, lambda: bridge.state.paused_before == "ATTEST", what="the holders to connect")
        await pilot.press("2")
        await pilot.pause()
        table = app.screen.query_one("#holders-table")
        assert table.row_count == 2  # type: ignore[attr-defined]
        await pilot.press("slash", *"bob", "enter")
        await pilot.pause()
        assert table.row_count == 1 and "filter bob" in screen_text(app)  # type: ignore[attr-defined]
        await pilot.press("escape")
        await pilot.pause()
        assert table.row_count == 2  # type: ignore[attr-defined]
        await pilot.press("c", "y")
        await until(pilot, lambda: not app.run_in_flight, what="cancel")


def test_a_second_run_in_one_console_goes_beside_out(tmp_path: Path) -> None:
    from gputravel.console.cli.launch import next_out_dir

    out = tmp_path / "mine"
    assert next_out_dir(out, 1) == out
    assert next_out_dir(out, 2) == tmp_path / "mine-2"
    (tmp_path / "mine-2").mkdir()
    (tmp_path / "mine-2" / "ledger.db").write_text("")  # taken: the next free one
    assert next_out_dir(out, 2) == tmp_path / "mine-3"


async def test_a_console_run_without_a_recording_still_writes_its_final_status(data_root: Path,
                                                                               tmp_path: Path) -> None:
    """``--no-record``: no recording to read the end from, so ``status.json`` is the run's word; ``runs``
    says completed while the console that ran it is still open (issue 25.3)."""
    import os

    from gputravel.console.view.run_info import read_run
    from gputravel.core.runfolder import mark_running, read_status

    umask = os.umask(0o022)
    os.umask(umask)
    built = factory_for(data_root, tmp_path)

    def factory() -> Any:  # as gputravel-console's: this console (a live process) holds the run's folder
        engine = built()
        mark_running(Path(engine.out_dir), owner="gputravel-console")
        return engine

    app = make_app(engine_factory=factory, telemetry_interval=0.5, record=False)
    try:
        async with app.run_test(size=SIZE) as pilot:
            bridge = live(app)
            await pilot.press("r")
            await until(pilot, lambda: bridge.state.status == "completed", what="completion")
            out = Path(bridge.session.out_dir)
            assert not (out / "recording.db").exists()
            assert read_status(out)["status"] == "completed" and read_status(out)["final"] is True
            assert read_run(out).status == "completed"  # not running: the console is open, the run over
            await pilot.press("q")
    finally:
        os.umask(umask)  # mark_running made this process's umask private
