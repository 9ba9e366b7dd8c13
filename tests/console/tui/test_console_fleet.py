"""The fleet in the console: a real fleet run at N = 2 (two torchrun ranks on gloo, each driving its own
emulated device, three local holders alice, bob and carol), its ranks' recordings merged into one view.

The fleet runs once for the module (about 10 s); the tests replay its folder, follow its recordings as the
real Recorder writes them again, and check the merge against the fleet's own report."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import until
from rich.console import Console
from textual.containers import VerticalScroll

from gputravel.console.entries import launch_gpus
from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.fleet_view import FleetBridge, FleetItem, FleetRecording, is_fleet_folder
from gputravel.console.tui.replay_bridge import ReplayBridge
from gputravel.console.tui.screens.gpu import GpuScreen
from gputravel.console.tui.screens.travel import TravelScreen
from gputravel.console.tui.widgets.device_card import DeviceCard
from gputravel.console.tui.widgets.route_map import RouteMap
from gputravel.console.tui.widgets.status_bar import StatusBar
from gputravel.console.tui.widgets.text import fmt_bytes
from gputravel.console.view.model import RunState
from gputravel.console.view.phase_fold import AWAY_PHASES
from gputravel.core import events as ev
from gputravel.core.bench.data import make_dataset
from gputravel.core.config import RunSettings
from gputravel.core.errors import RecordingError
from gputravel.core.fleet.rank import FleetOptions
from gputravel.core.recording import RecordedItem, Recorder, load_recording
from gputravel.core.telemetry import NA

HOLDERS = ("alice", "bob", "carol")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A finished fleet run folder (``rank-0``, ``rank-1``) and its report."""
    data = tmp_path_factory.mktemp("holders")
    for name in HOLDERS:
        make_dataset(data / name, 40_000)
    # Both GPUs are away together only while the ranks' first visits overlap in time: about 10 ms of a quiet run,
    # which a loaded machine can skew apart. The replay tests need that moment, so a run without it is run again
    # (a fresh folder each time; at most three).
    for _ in range(3):
        out = tmp_path_factory.mktemp("fleet") / "out"
        settings = RunSettings(holders=3, rounds=1, steps_per_visit=2, buffer_mib=0.125, data_dir=data,
                               out_dir=out, batch_size=4, seq_len=32, chunk_kib=32, torch_threads=1,
                               transport="local", visit_attempts=1)
        report = launch_gpus(settings, FleetOptions(gpus=2, timeout_s=120), quiet=True)
        if first_visits_overlap(out):
            break
    return out, report


def away_spans(folder: Path) -> list[tuple[float, float]]:
    """When one rank's GPU was at a holder: from a visit's first phase away (HANDOFF) to its RETURN's end."""
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for event in load_recording(folder / "recording.db").events():
        if isinstance(event, ev.PhaseStarted) and event.phase in AWAY_PHASES and start is None:
            start = event.t
        elif isinstance(event, ev.PhaseCompleted) and event.phase == "RETURN" and start is not None:
            spans.append((start, event.t))
            start = None
    return spans


def first_visits_overlap(out: Path) -> bool:
    firsts = [away_spans(out / f"rank-{r}")[:1] for r in (0, 1)]
    if not all(firsts):
        return False
    (a0, a1), (b0, b1) = firsts[0][0], firsts[1][0]
    return max(a0, b0) < min(a1, b1)


def screen_text(app: GpuTravelConsole) -> str:
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def seek_until(bridge: ReplayBridge | FleetBridge, cond: Callable[[RunState], bool]) -> int:
    """Move the replay cursor to the first position where ``cond(state)`` holds."""
    for position in range(len(bridge.playback.player.items) + 1):
        bridge.playback.seek(position)
        if cond(bridge.state):
            return position
    raise AssertionError("the recording never reaches that state")


def where(state: RunState) -> dict[str, str]:
    return {d.label: d.at for d in state.devices()}


def rank_reports(out: Path) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"rank-{r}" / "report.json").read_text()) for r in (0, 1)}


def write_again(recorder: Recorder, item: RecordedItem) -> None:
    """One recorded item written again by the real Recorder (an event, or a telemetry frame)."""
    if item.kind == "telemetry":
        recorder.record_telemetry(item.frame())
    else:
        recorder(item.event())


def test_the_ranks_recordings_merge_by_time_each_item_tagged_with_its_gpu(fleet: tuple[Path, dict]) -> None:
    out, _ = fleet
    assert is_fleet_folder(out) and not is_fleet_folder(out / "rank-0")
    merged = FleetRecording(out)
    ranks = {r: load_recording(out / f"rank-{r}" / "recording.db") for r in (0, 1)}
    assert merged.gpus == 2 and set(merged.rank_files()) == {0, 1}
    assert len(merged.items) == sum(len(r.items) for r in ranks.values())
    assert [i.t for i in merged.items] == sorted(i.t for i in merged.items)
    for rank, rec in ranks.items():  # each rank's items, in its own order, tagged with it
        assert [(i.seq, i.name) for i in merged.items if i.gpu == rank] == [(i.seq, i.name) for i in rec.items]
    assert merged.more() == ()  # a finished fleet: nothing appended since
    assert merged.recording().meta["ledger"] == str(out / "ledger.db")


def test_a_sample_stamped_before_an_event_recorded_ahead_of_it_keeps_its_ranks_order(tmp_path: Path) -> None:
    """A rank's telemetry thread may stamp a sample a moment before the engine's event it records after: the merge
    keeps each rank's recorded order and still reads in time order."""
    for rank, stamps in ((0, (1.0, 0.9, 1.5)), (1, (1.2, 1.3, 1.4))):
        folder = tmp_path / f"rank-{rank}"
        folder.mkdir()
        rec = Recorder(folder / "recording.db", meta={"rank": rank})
        for n, t in enumerate(stamps):
            rec.record_event(ev.HolderConnected(t, f"h{n}", "byte", 1, 0, "0" * 64))
        rec.close()
    merged = FleetRecording(tmp_path)
    assert [(i.gpu, i.seq) for i in merged.items] == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (0, 3)]
    assert [i.t for i in merged.items] == sorted(i.t for i in merged.items)


def test_a_folder_without_rank_recordings_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="not a `gputravel run --gpus N` folder"):
        FleetRecording(tmp_path)
    with pytest.raises(RecordingError, match="no such fleet run folder"):
        FleetRecording(tmp_path / "missing")


def test_merged_state_tags_every_visit_with_the_gpu_and_device_the_fleet_report_names(
        fleet: tuple[Path, dict]) -> None:
    out, report = fleet
    state = RunState(fleet_size=2)
    for item in FleetRecording(out).items:
        if item.kind == "event":
            state.apply(item.event(), gpu=item.gpu)
    assert state.status == "completed" and state.visits_planned == len(report["visits"]) == 3
    tagged = sorted((v.visit, v.holder, v.gpu, v.device, v.outcome) for v in state.visits.values())
    expected = sorted((v["visit"], v["holder"], v["gpu"], v["device"], "done") for v in report["visits"])
    assert tagged == expected
    devices = {d.device_id: d for d in state.devices()}
    for dev in report["fleet"]["devices"]:  # each card's epoch is its own device's
        assert devices[dev["device_id"]].epoch == dev["epochs"] and devices[dev["device_id"]].attested is True
    assert sum(d.visits_done for d in devices.values()) == 3
    assert all(d.provisioned_bytes > 0 and d.last_mb_s for d in devices.values())


def test_each_rank_records_telemetry_from_its_own_device_ending_with_its_reported_bytes(
        fleet: tuple[Path, dict]) -> None:
    out, report = fleet
    ids = {d["rank"]: d["device_id"] for d in report["fleet"]["devices"]}
    mine = rank_reports(out)
    for rank in (0, 1):
        frames = load_recording(out / f"rank-{rank}" / "recording.db").frames()
        assert frames, f"rank {rank} recorded no telemetry"
        sims = [d for f in frames for d in f.devices if d.sim]
        assert sims and all(d.uuid in (NA, ids[rank]) for d in sims)  # NA: sampled before its attestation
        last = frames[-1].devices
        assert [d.uuid for d in last if d.sim] == [ids[rank]]
        # the last sample is taken when the run is done, before the device stops: its final counters
        assert [d.rx_bytes for d in last if d.sim] == [mine[rank]["provisioning"]["bytes"]]
        nvml = [d for f in frames for d in f.devices if not d.sim]
        if frames[-1].nvml.available:  # a rank samples only its own CUDA device (LOCAL_RANK = rank here)
            assert {d.index for d in nvml} <= {rank}
        else:  # no driver: "not available", with the reason, and no device
            assert not nvml and "NVML" in (frames[-1].nvml.reason or "")
    assert mine[0]["provisioning"]["bytes"] != mine[1]["provisioning"]["bytes"]  # two visits on GPU0, one on GPU1


def test_fleet_is_over_only_when_every_gpu_is(fleet: tuple[Path, dict]) -> None:
    out, _ = fleet
    state = RunState(fleet_size=2)
    items = [i for i in FleetRecording(out).items if i.kind == "event"]
    first_end = next(n for n, i in enumerate(items) if i.name == "RunCompleted")
    for item in items[: first_end + 1]:
        state.apply(item.event(), gpu=item.gpu)
    ended = {gpu: own.status for gpu, own in state.gpus.items()}
    assert "completed" in ended.values() and state.status == "running"  # one GPU done, the fleet not
    for item in items[first_end + 1:]:
        state.apply(item.event(), gpu=item.gpu)
    assert state.status == "completed" and state.ended


async def test_replay_of_a_fleet_folder_puts_two_gpus_on_the_route_each_at_its_holder(
        fleet: tuple[Path, dict]) -> None:
    out, report = fleet
    at_holder = {v["holder"]: f"GPU{v['gpu']}" for v in report["visits"]}  # alice: GPU0, bob: GPU1, ...
    app = make_app(replay=out)
    async with app.run_test(size=(160, 45)) as pilot:
        bridge = app.bridge
        assert isinstance(bridge, FleetBridge) and isinstance(app.screen, TravelScreen)
        seek_until(bridge, lambda s: len(s.gpus) == 2 and all(at != "orchestrator" for at in where(s).values()))
        await pilot.pause()
        away = where(bridge.state)
        assert away == {at_holder["alice"]: "alice", at_holder["bob"]: "bob"}
        assert app.screen.query_one(RouteMap).view.gpus == tuple(sorted(away.items()))
        text = screen_text(app)
        for label, holder in away.items():
            assert f"{label} ◆ {holder}" in text  # the panel's line per GPU
            line = next(x for x in text.splitlines() if f"──▶ {holder} " in x)
            assert f"◆ {label}" in line  # its marker beside its holder on the route
        assert "GPUs ◆ 0→alice 1→bob" in text and "FLEET ×2 SIM" in text
        seek_until(bridge, lambda s: where(s).get(at_holder["carol"]) == "carol")
        await pilot.pause()
        assert f"{at_holder['carol']} ◆ carol" in screen_text(app)
        await pilot.press("end")
        await pilot.pause()
        text = screen_text(app)
        assert bridge.state.status == "completed" and set(where(bridge.state).values()) == {"orchestrator"}
        orchestrator = [x for x in text.splitlines() if "│ orchestrator │" in x or "┌─────" in x]
        assert any("◆ GPU0" in x for x in orchestrator) and any("◆ GPU1" in x for x in orchestrator)
        rows = [x.split() for x in text.splitlines() if x.strip()[:1].isdigit() and "GPU" in x]
        assert sorted((int(r[0]) - 1, r[1], r[2]) for r in rows) == sorted(
            (v["visit"], f"GPU{v['gpu']}", v["holder"]) for v in report["visits"])  # the timeline's gpu column


async def test_gpu_screen_has_one_sim_card_per_device_and_they_scroll_in_80x24(fleet: tuple[Path, dict]) -> None:
    out, report = fleet
    app = make_app(replay=out)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("end", "4")
        await until(pilot, lambda: isinstance(app.screen, GpuScreen) and len(app.screen.query(DeviceCard)) == 2,
                    what="two SIM cards")
        cards = list(app.screen.query(DeviceCard))
        views = [c.view for c in cards]
        assert [(v.gpu, v.device_id, v.sim) for v in views if v] == [
            (d["rank"], d["device_id"], True) for d in report["fleet"]["devices"]]
        assert [c.id for c in cards] == ["device-card-0", "device-card-1"]
        text = screen_text(app)
        assert "GPU0 · emu-gpu-0 · SIM" in text and "GPU1 · emu-gpu-1 · SIM" in text
        assert "fleet 2/2 GPUs" in text
        mine = rank_reports(out)
        for card in cards:  # each card: its own device's counters, as its rank's last frame has them
            assert card.view is not None and card.counters is not None
            gpu = card.view.gpu
            last = load_recording(out / f"rank-{gpu}" / "recording.db").frames()[-1]
            sample = card.counters.sample
            assert sample.uuid == card.view.device_id and sample.rx_bytes == mine[gpu]["provisioning"]["bytes"]
            assert card.counters.phase == last.phase and sample.mem_used == last.devices[0].mem_used
            lines = card.render().plain.splitlines()
            sampled = next(x for x in lines if x.startswith("sample "))
            assert f"{fmt_bytes(sample.rx_bytes)} in" in sampled and f"{fmt_bytes(sample.mem_used)} in use" in sampled
            assert (last.phase or "between phases") in sampled
            assert any(x.startswith("PCIe RX ") for x in lines)
        totals = [c.counters.sample.rx_bytes for c in cards if c.counters]
        assert len(set(totals)) == 2  # two devices, two byte totals
    app = make_app(replay=out)
    async with app.run_test(size=(80, 24)) as pilot:  # the compact layout: one card shows, the other scrolls
        await pilot.press("end", "4")
        await until(pilot, lambda: isinstance(app.screen, GpuScreen) and len(app.screen.query(DeviceCard)) == 2,
                    what="two SIM cards")
        await pilot.pause()
        box = app.screen.query_one("#gpu-cards", VerticalScroll)
        def bottoms() -> int:  # cards whose bottom border is on screen
            return sum(1 for line in screen_text(app).splitlines() if line.lstrip().startswith("╰─"))

        assert box.max_scroll_y > 0 and bottoms() == 1  # the second card runs off the bottom
        await pilot.press("pagedown")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y and bottoms() == 2
        await pilot.press("up")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y - 1
        await pilot.press("1")
        await pilot.pause()
        text = screen_text(app)
        assert "◆0" in text and "◆1" in text and "GPU0 ◆ orch" in text  # 80 columns: the short form


async def test_replay_of_one_rank_still_opens_that_gpu_alone(fleet: tuple[Path, dict]) -> None:
    out, _ = fleet
    app = make_app(replay=out / "rank-1" / "recording.db")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("end")
        await pilot.pause()
        bridge = app.bridge
        assert isinstance(bridge, ReplayBridge) and not isinstance(bridge, FleetBridge)
        assert not bridge.state.fleet and bridge.state.device_id == "emu-gpu-1"
        assert all(v.gpu is None for v in bridge.state.visits.values())
        assert "GPU ◆ orchestrator" in screen_text(app)


async def test_following_a_running_fleet_is_read_only_and_picks_up_every_rank(fleet: tuple[Path, dict],
                                                                             tmp_path: Path) -> None:
    """The ranks' events written again by the real Recorder while the console follows the folder: rank 1's
    file appears only after the console has opened."""
    out, _ = fleet
    follow = tmp_path / "out"
    ranks = {r: load_recording(out / f"rank-{r}" / "recording.db") for r in (0, 1)}
    recorders = {0: Recorder(follow / "rank-0" / "recording.db", meta=dict(ranks[0].meta))}
    half = len(ranks[0].items) // 2
    for item in ranks[0].items[:half]:
        write_again(recorders[0], item)
    app = make_app(replay=follow, readonly=True, follow=True)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            bridge = app.bridge
            assert isinstance(bridge, FleetBridge) and bridge.follow
            # the view moves (pause, step: issue 25.1); the fleet is torchrun's: no cancel, no breakpoint
            assert app.check_action("step", ()) is True and app.check_action("toggle_pause", ()) is True
            assert app.check_action("cancel", ()) is False and app.check_action("toggle_break", ()) is False
            await until(pilot, lambda: bridge.playback.player.position == half, what="rank 0's first half")
            assert list(bridge.state.gpus) == [0] and bridge.state.status != "completed"
            recorders[1] = Recorder(follow / "rank-1" / "recording.db", meta=dict(ranks[1].meta))
            for rank, rec in ranks.items():
                for item in rec.items[half if rank == 0 else 0:]:
                    write_again(recorders[rank], item)
            await until(pilot, lambda: bridge.state.status == "completed", what="the fleet's end")
            assert list(bridge.state.gpus) == [0, 1] and len(bridge.state.visits) == 3
            assert sum(isinstance(i, FleetItem) and i.gpu == 1 for i in bridge.playback.player.items) == len(ranks[1].items)
            bar = app.screen.query_one(StatusBar).summary
            assert bar is not None and "READ-ONLY · torchrun drives" in bar.badges
            assert "FOLLOW ▶" in bar.badges
            assert "READ-ONLY · torchrun drives" in screen_text(app)
            last = {r: rec.frames()[-1] for r, rec in ranks.items()}  # each GPU's last frame, followed too
            want = {r: f.devices[0].rx_bytes for r, f in last.items()}
            await until(pilot, lambda: {g: f.devices[0].rx_bytes for g, f in bridge.rank_frames.items()} == want,
                        timeout=10, what=f"every GPU's last frame {want}")
    finally:
        for rec in recorders.values():
            rec.close()


def test_console_replay_option_opens_a_fleet_folder(fleet: tuple[Path, dict]) -> None:
    """``gputravel-console --replay <out>``: the same app a fleet folder builds (make_app decides by path)."""
    out, _ = fleet
    app = make_app(replay=out)
    assert isinstance(app.bridge, FleetBridge) and app.bridge.fleet.gpus == 2
    assert json.loads((out / "fleet.json").read_text())["fleet"]["gpus"] == app.bridge.state.fleet_size


def test_a_nodes_folder_shows_its_own_ranks_names_the_others_and_merges_given_node_folders(
        fleet: tuple[Path, dict], tmp_path: Path) -> None:
    """Issue 36: a fleet over two nodes sharing no folder. Each node's folder holds its own rank (made here from
    the module's fleet: node A keeps rank 0 and the fleet ledger, node B rank 1). ``replay``, ``runs show`` and
    the console's replay of either say the other rank ran on another node, and merge it with --node-folder."""
    import shutil

    from typer.testing import CliRunner

    from gputravel.console.cli.main import app as cli

    out, _ = fleet
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    shutil.copytree(out, node_a)
    shutil.copytree(out, node_b)
    shutil.rmtree(node_a / "rank-1")
    shutil.rmtree(node_b / "rank-0")
    (node_b / "ledger.db").unlink()
    whole = json.loads(CliRunner().invoke(cli, ["replay", str(out), "--json"]).output)
    alone = CliRunner().invoke(cli, ["replay", str(node_a), "--json"])
    assert alone.exit_code == 0, alone.output
    mine = json.loads(alone.output)
    assert mine["nodes"]["here"] == [0] and mine["nodes"]["elsewhere"] == [1]
    assert {e["gpu"] for e in mine["events"]} == {0}
    text = CliRunner().invoke(cli, ["replay", str(node_b)]).output
    assert "rank(s) 0 of 2 ran on other nodes" in " ".join(text.split())
    both = json.loads(CliRunner().invoke(cli, ["replay", str(node_a), "--node-folder", str(node_b), "--json"]).output)
    assert both["nodes"]["merged"] == [1] and both["nodes"]["elsewhere"] == []
    assert both["events"] == whole["events"] and both["summary"] == whole["summary"]
    shown = json.loads(CliRunner().invoke(cli, ["runs", "show", str(node_b), "--json"]).output)
    assert shown["nodes"]["elsewhere"] == [0] and "other nodes" in shown["nodes"]["note"]
    merged = json.loads(CliRunner().invoke(cli, ["runs", "show", str(node_b), "--node-folder", str(node_a),
                                                 "--json"]).output)
    assert merged["nodes"]["elsewhere"] == [] and merged["summary"] == whole["summary"]
    for bad, why in ((out / "rank-0", "not a fleet node's folder"), (out, "rank 0 is in")):  # not a node; a rank twice
        refused = CliRunner().invoke(cli, ["replay", str(node_a), "--node-folder", str(bad)])
        assert refused.exit_code == 2 and why in " ".join(refused.output.split()), refused.output
    # the console's replay: node A alone names GPU 1 as elsewhere; with node B's folder it plays both GPUs
    lone = make_app(replay=node_a)
    assert isinstance(lone.bridge, FleetBridge) and "GPU 1 ON OTHER NODES" in lone.bridge.badges
    full = make_app(replay=node_a, nodes=(node_b,))
    assert isinstance(full.bridge, FleetBridge) and full.bridge.fleet.elsewhere == ()
    assert set(full.bridge.fleet.rank_files()) == {0, 1}
    assert len(full.bridge.fleet.items) == len(FleetRecording(out).items)
