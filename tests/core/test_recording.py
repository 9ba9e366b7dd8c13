"""Record and replay: events and telemetry in SQLite, read back exactly, walked phase by phase."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.console.cli import main as cli
from gputravel.console.view.model import RunState
from gputravel.core import events as ev
from gputravel.core.recording import Player, Recorder, RecordingError, event_from_dict, load_recording
from gputravel.core.telemetry import GpuSample, NvmlStatus, TelemetryFrame


def one_visit(path: Path) -> Path:
    rec = Recorder(path, meta={"settings": {"holders": 1}})
    rec(ev.RunStarted(1.0, "r1", {"kind": "emulated", "sim": True}, ("alice",), 1))
    for i, phase in enumerate(("ATTEST", "HANDOFF", "PROVISION")):
        rec(ev.PhaseStarted(2.0 + i, 0, "alice", phase, 1))
        if phase == "PROVISION":
            rec.record_telemetry(TelemetryFrame(t=4.5, source="emulated", nvml=NvmlStatus(False, "no driver"),
                                                devices=(GpuSample(index=0, name="emu", sim=True, pcie_rx_bps=1e8),),
                                                phase="alice · PROVISION"))
            rec(ev.ChunkRejected(4.6, 0, "alice", 1, 3, "replay", "sequence 3 seen twice"))
        rec(ev.PhaseCompleted(2.5 + i, 0, "alice", phase, 1, 0.5, "ok", 10, "fp" if phase != "ATTEST" else None))
    rec(ev.TrainingStepped(6.0, 0, "alice", 2, (5.0, 4.5), 4.8, 1000.0))
    rec(ev.RunCompleted(7.0, "r1", 1, 0, 6.0))
    rec.close()
    return path


def test_recording_round_trips_events_and_telemetry_in_order(tmp_path: Path) -> None:
    recording = load_recording(one_visit(tmp_path / "r.db"))
    assert recording.meta["settings"] == {"holders": 1} and recording.meta["version"] == 1
    assert [i.kind for i in recording.items].count("telemetry") == 1
    events = recording.events()
    assert events[0] == ev.RunStarted(1.0, "r1", {"kind": "emulated", "sim": True}, ("alice",), 1)
    assert ev.TrainingStepped(6.0, 0, "alice", 2, (5.0, 4.5), 4.8, 1000.0) in events  # tuples restored
    frame = recording.frames()[0]
    assert frame.phase == "alice · PROVISION" and frame.devices[0].pcie_rx_bps == 1e8
    seqs = [i.seq for i in recording.items]
    assert seqs == sorted(seqs)


def test_player_steps_one_phase_at_a_time_and_seeks_visits(tmp_path: Path) -> None:
    player = Player(load_recording(one_visit(tmp_path / "r.db")))
    first = player.step_phase()
    assert [i.name for i in first] == ["RunStarted", "PhaseStarted", "PhaseCompleted"]
    second = player.step_phase()
    assert second[-1].body["phase"] == "HANDOFF"
    third = player.step_phase()
    assert [i.kind for i in third].count("telemetry") == 1 and third[-1].body["phase"] == "PROVISION"
    player.seek_visit(0)
    assert player.position == 1 and player.current_visit() == -1
    player.seek_visit(5)
    assert player.at_end


def test_folding_a_recording_gives_the_run_state(tmp_path: Path) -> None:
    state = RunState()
    for event in load_recording(one_visit(tmp_path / "r.db")).events():
        state.apply(event)
    assert state.status == "completed" and state.rejected_total == {"replay": 1}
    assert state.holders["alice"].rejected["replay"] == 1
    assert state.loss == [(1, 5.0), (2, 4.5)] and state.val == [(2, "alice", 4.8)]
    visit = state.visit(0)
    assert visit is not None and visit.phases["PROVISION"].status == "ok" and visit.key_fp == "fp"


def test_replay_json_prints_events_telemetry_and_summary(tmp_path: Path) -> None:
    path = one_visit(tmp_path / "r.db")
    result = CliRunner().invoke(cli.app, ["replay", str(path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [e["kind"] for e in out["events"]][0] == "RunStarted"
    assert out["telemetry"][0]["phase"] == "alice · PROVISION"
    assert out["summary"]["status"] == "completed" and out["summary"]["rejected"] == {"replay": 1}
    text = CliRunner().invoke(cli.app, ["replay", str(path)])
    assert text.exit_code == 0 and "chunk 3 rejected: replay" in text.output


def test_a_missing_or_foreign_file_is_a_recording_error(tmp_path: Path) -> None:
    with pytest.raises(RecordingError):
        load_recording(tmp_path / "nope.db")
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE x (y)").connection.close()
    with pytest.raises(RecordingError):
        load_recording(other)
    with pytest.raises(RecordingError):
        event_from_dict({"kind": "NoSuchEvent"})
