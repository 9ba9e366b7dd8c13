"""``gputravel runs``, ``replay`` and ``ledger``: the truth about every run from one place (``status.json``, the
recorded process, the recording, a fleet's report) and one run address everywhere (issue 25.3, 25.4, 25.9)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.console.cli.run_end import RunEnding
from gputravel.core import events as ev
from gputravel.core.ledger import Ledger
from gputravel.core.recording import Recorder
from gputravel.core.runfolder import mark_running, read_status


@pytest.fixture(autouse=True)
def _umask_kept() -> Any:
    """mark_running makes this process's umask private (0077): give the rest of the session its own back."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def cli(*args: str, cwd: Path | None = None) -> Any:
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        os.chdir(here)


def _record(path: Path, events: list[ev.Event]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(path, meta={})
    for event in events:
        rec(event)
    rec.close()


def _visit(run_id: str, t0: float, holder: str, *, end: ev.Event | None, visit: int = 0) -> list[ev.Event]:
    out: list[ev.Event] = [ev.RunStarted(t0, run_id, {"kind": "emulated", "sim": True}, (holder,), 1),
                           ev.PhaseStarted(t0 + 1, visit, holder, "PROVISION", 1),
                           ev.VisitCompleted(t0 + 2, visit, holder, 1, ev.VisitSummary())]
    return out + ([end] if end is not None else [])


def _status(root: Path, name: str) -> str:
    result = cli("runs", "show", name, "--runs-dir", str(root), "--json")
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["status"])


def _ledger(path: Path) -> None:
    with Ledger.open(path, run_id="r") as ledger:
        for i in range(3):
            ledger.append(kind="phase", phase="train", holder="a", epoch=i, key_fp=None, nbytes=i, duration_s=0.1,
                          detail={}, state={})


# --- 25.3: truthful status ----------------------------------------------------------------------------------
def test_a_finished_run_whose_console_is_still_open_is_not_running(tmp_path: Path) -> None:
    run = tmp_path / "run-a"
    _record(run / "recording.db", _visit("r1", 1.0, "alice", end=ev.RunCompleted(4.0, "r1", 1, 0, 3.0)))
    mark_running(run, owner="gputravel-console")  # this (live) process still holds the folder
    assert _status(tmp_path, "run-a") == "completed"


def test_a_paused_run_reads_paused_while_its_process_lives(tmp_path: Path) -> None:
    run = tmp_path / "run-p"
    _record(run / "recording.db", [*_visit("r2", 1.0, "alice", end=None), ev.RunPaused(3.0, "break", "TRAIN")])
    mark_running(run, owner="gputravel run")
    assert _status(tmp_path, "run-p") == "paused"


def test_the_run_writes_its_status_when_it_pauses_goes_on_and_ends(tmp_path: Path) -> None:
    ending = RunEnding(tmp_path)
    ending(ev.RunStarted(1.0, "r3", {}, ("alice",), 1))
    ending(ev.RunPaused(2.0, "break", "TRAIN"))
    assert read_status(tmp_path)["status"] == "paused"
    ending(ev.RunResumed(3.0))
    assert read_status(tmp_path) == {}
    ending(ev.RunFailed(4.0, "r3", "stopped", "cancelled"))
    assert read_status(tmp_path)["status"] == "cancelled" and read_status(tmp_path)["final"] is True
    # and it is what `runs` says, with or without a recording
    assert _status(tmp_path.parent, tmp_path.name) == "cancelled"


def test_a_completed_fleet_reads_completed_with_every_ranks_visits(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet-1"
    fleet.mkdir()
    (fleet / "fleet.json").write_text(json.dumps({"settings": {"holders": 2}, "fleet": {"gpus": 2}}))
    _ledger(fleet / "ledger.db")
    for gpu, holder in enumerate(("north", "south")):
        _record(fleet / f"rank-{gpu}" / "recording.db",
                _visit("f1", 2.0 - gpu, holder, end=ev.RunCompleted(5.0 + gpu, "f1", 1, 0, 4.0), visit=gpu))
    (fleet / "report.json").write_text(json.dumps({"run_id": "f1", "failed_visits": 0}))
    shown = json.loads(cli("runs", "show", "fleet-1", "--runs-dir", str(tmp_path), "--json").stdout)
    assert (shown["status"], shown["fleet"], shown["visits_done"]) == ("completed", True, 2)
    # on screen: visit order (GPU1's visit 2 ran first), each visit naming its GPU
    text = cli("runs", "show", "fleet-1", "--runs-dir", str(tmp_path)).stdout
    rows = [line.split()[:3] for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert rows == [["1", "GPU0", "north"], ["2", "GPU1", "south"]]
    assert "recordings rank-0/recording.db, rank-1/recording.db" in text  # every rank's, not the first alone


def test_the_console_panel_and_runs_ls_count_visits_alike(tmp_path: Path) -> None:
    """One visit done, one failed, one never run: the travel panel and ``runs ls`` both say 1/3 (1✗)."""
    from gputravel.console.view.model import RunState

    events = [ev.RunStarted(1.0, "c1", {"kind": "emulated", "sim": True}, ("alice", "bob"), 3),
              ev.PhaseStarted(2.0, 0, "alice", "PROVISION", 1), ev.VisitCompleted(3.0, 0, "alice", 1, ev.VisitSummary()),
              ev.PhaseStarted(4.0, 1, "bob", "PROVISION", 2),
              ev.VisitFailed(5.0, 1, "bob", 2, "PROVISION", "agent lost", "agent"),
              ev.RunCompleted(6.0, "c1", 1, 1, 5.0)]
    _record(tmp_path / "run-c" / "recording.db", events)
    state = RunState()
    for event in events:
        state.apply(event)
    assert state.visits_label() == "1/3 visits (1✗)"
    row = next(line for line in cli("runs", "ls", "--runs-dir", str(tmp_path)).stdout.splitlines() if "run-c" in line)
    assert "1/3 (1✗)" in row


def test_a_fleet_whose_report_names_an_error_reads_failed(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet-2"
    fleet.mkdir()
    (fleet / "fleet.json").write_text(json.dumps({"settings": {}, "fleet": {}}))
    (fleet / "report.json").write_text(json.dumps({"error": {"code": "fleet-device-lost", "reason": "gpu 1"}}))
    assert _status(tmp_path, "fleet-2") == "failed"


# --- 25.4: one run address ----------------------------------------------------------------------------------
@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    _record(root / "run-20260101-100000" / "recording.db",
            _visit("old", 1.0, "alice", end=ev.RunCompleted(4.0, "old", 1, 0, 3.0)))
    _record(root / "run-20260102-100000" / "recording.db",
            _visit("new", 1.0, "bob", end=ev.RunCompleted(4.0, "new", 1, 0, 3.0)))
    _ledger(root / "run-20260102-100000" / "ledger.db")
    fleet = root / "fleet-20260103"
    fleet.mkdir()
    (fleet / "fleet.json").write_text(json.dumps({"settings": {}, "fleet": {}}))
    _ledger(fleet / "ledger.db")
    for gpu, holder in enumerate(("north", "south")):
        _record(fleet / f"rank-{gpu}" / "recording.db",
                _visit("fl", 1.0 + gpu, holder, end=ev.RunCompleted(5.0 + gpu, "fl", 1, 0, 4.0)))
        _ledger(fleet / f"rank-{gpu}" / "ledger.db")
    (root / "latest").symlink_to("run-20260102-100000")
    return tmp_path


@pytest.mark.parametrize(("address", "run_id"), [
    ("latest", "new"), ("run-20260101", "old"), ("run-20260102-100000", "new"),
    ("runs/run-20260101-100000", "old"), ("runs/run-20260101-100000/recording.db", "old"),
])
def test_every_run_command_takes_the_same_addresses(runs: Path, address: str, run_id: str) -> None:
    shown = cli("runs", "show", address, "--json", cwd=runs)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["run_id"] == run_id
    replayed = cli("replay", address, "--json", cwd=runs)
    assert replayed.exit_code == 0, replayed.output
    assert json.loads(replayed.stdout)["summary"]["run_id"] == run_id
    log = cli("runs", "log", address, "--json", cwd=runs)
    assert log.exit_code == 0 and json.loads(log.stdout.splitlines()[0])["run_id"] == run_id


def test_a_fleet_folder_is_logged_replayed_and_verified_by_its_name(runs: Path) -> None:
    log = cli("runs", "log", "fleet", "--json", cwd=runs)
    assert log.exit_code == 0, log.output
    assert {json.loads(line).get("gpu") for line in log.stdout.splitlines()} == {0, 1}
    replayed = cli("replay", "runs/fleet-20260103", "--json", cwd=runs)
    assert replayed.exit_code == 0, replayed.output
    assert json.loads(replayed.stdout)["fleet"] is True
    assert len([e for e in json.loads(replayed.stdout)["events"] if e["kind"] == "RunCompleted"]) == 2
    verified = cli("ledger", "verify", "fleet", cwd=runs)  # the fleet's check: its ledger and every rank's
    assert "the fleet ledger records no head" in verified.output  # (these ranks never joined a real fleet)
    assert cli("ledger", "show", "latest", "--json", cwd=runs).exit_code == 0


def test_an_ambiguous_prefix_is_refused_naming_the_runs(runs: Path) -> None:
    result = cli("runs", "show", "run-2026", "--json", cwd=runs)
    assert result.exit_code == 2
    message = json.loads(result.stdout)["error"]["message"]
    assert "ambiguous" in message and "run-20260101-100000" in message and "run-20260102-100000" in message


# --- 25.9: the ledger head, whole and by prefix ---------------------------------------------------------------
def test_the_head_is_printed_alone_on_its_line_within_80_columns(runs: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    result = cli("ledger", "verify", "latest", cwd=runs)
    assert result.exit_code == 0, result.output
    head = result.stdout.strip().splitlines()[-1]
    seq, digest = head.split(":")
    assert seq == "3" and len(digest) == 64 and len(head) <= 80


def test_verify_head_takes_an_unambiguous_prefix(runs: Path) -> None:
    head = cli("ledger", "verify", "latest", cwd=runs).stdout.strip().splitlines()[-1]
    seq, digest = head.split(":")
    for given in (f"{seq}:{digest[:16]}", digest[:20], head):
        result = cli("ledger", "verify", "latest", "--head", given, cwd=runs)
        assert result.exit_code == 0, (given, result.output)
        assert "contains the recorded head 3" in result.stdout
    too_short = cli("ledger", "verify", "latest", "--head", digest[:8], cwd=runs)
    assert too_short.exit_code == 2 and "16 hex digits" in too_short.output
    mistyped = cli("ledger", "verify", "latest", "--head", "f" * 20, "--json", cwd=runs)  # a typo: no verdict
    message = json.loads(mistyped.stdout)["error"]["message"]
    assert mistyped.exit_code == 2 and "no row of" in message and "f" * 20 in message and "rewritten" not in message
    rewritten = cli("ledger", "verify", "latest", "--head", f"{seq}:{'f' * 64}", "--json", cwd=runs)
    assert rewritten.exit_code == 8 and "rewritten" in json.loads(rewritten.stdout)["error"]["message"]


def test_the_console_replays_any_run_address(runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gputravel.console.tui import app as console_app

    played: list[Any] = []

    class Played:
        def run(self) -> None:
            pass

    def fake_make_app(**kw: Any) -> Played:
        played.append(kw["replay"])
        return Played()

    monkeypatch.setattr(console_app, "make_app", fake_make_app)
    monkeypatch.chdir(runs)
    for address, want in (("latest", "runs/run-20260102-100000/recording.db"),
                          ("run-20260101", "runs/run-20260101-100000/recording.db"),
                          ("fleet", "runs/fleet-20260103"), ("runs/run-20260101-100000", None)):
        result = CliRunner().invoke(console_app.cli, ["--replay", address])
        assert result.exit_code == 0, (address, result.output)
        if want is not None:
            assert Path(played[-1]).resolve() == (runs / want).resolve(), address
    assert CliRunner().invoke(console_app.cli, ["--replay", "nothing-here"]).exit_code != 0


# --- 24.9: private run folders, never a user's own folder ---------------------------------------------------
def test_an_out_folder_of_the_users_own_is_never_tightened(tmp_path: Path) -> None:
    import stat

    from gputravel.core.runfolder import RunClaim

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    tool = mine / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    folder = RunClaim(mine)
    folder.claim()
    folder.tighten()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755 and stat.S_IMODE(tool.stat().st_mode) == 0o755


def test_an_existing_run_folder_is_closed_but_a_readable_key_in_it_is_not_quietly_fixed(tmp_path: Path) -> None:
    import stat

    from gputravel.core.runfolder import RunClaim

    run = tmp_path / "run-old"
    (run / "keys").mkdir(parents=True)
    run.chmod(0o755)
    (run / "settings.json").write_text("{}")
    (run / "keys" / "checkpoint.key").write_bytes(b"k" * 32)
    (run / "keys" / "checkpoint.key").chmod(0o644)
    folder = RunClaim(run)
    folder.claim()  # --resume of a folder from before runs were private
    folder.tighten()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700  # nobody else reaches anything in it
    assert stat.S_IMODE((run / "keys" / "checkpoint.key").stat().st_mode) == 0o644  # refused by the resume


def test_a_folder_made_for_the_run_loses_group_and_other_bits_everywhere(tmp_path: Path) -> None:
    import stat

    from gputravel.core.runfolder import RunClaim

    run = tmp_path / "run-new"
    folder = RunClaim(run)
    folder.claim()
    (run / "cert.pem").write_text("public")
    (run / "cert.pem").chmod(0o644)
    (run / "hook").write_text("#!/bin/sh\n")
    (run / "hook").chmod(0o755)
    folder.tighten()  # as the run does when it ends
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (run, run / "cert.pem", run / "hook")}
    assert modes == {"run-new": 0o700, "cert.pem": 0o600, "hook": 0o700}


# --- 35.3: a pipe gets whole lines with wall-clock times -------------------------------------------------------
def test_a_piped_log_is_one_line_per_event_with_its_iso_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``runs log | grep`` and ``replay | grep`` return whole lines (rich wrapped them at 80 columns: 54 events
    became 66 lines) and each line carries its ISO 8601 UTC time beside the offset."""
    monkeypatch.delenv("COLUMNS", raising=False)
    long = "a detail long enough to wrap twice at eighty columns " * 3
    t0 = 1_790_000_000.25  # 2026-09-21T14:13:20.250Z
    events: list[ev.Event] = [ev.RunStarted(t0, "p", {"kind": "emulated", "sim": True}, ("alice",), 1),
                              ev.HolderStateChanged(t0 + 1.5, "alice", "provisioning", long),
                              ev.RunCompleted(t0 + 2, "p", 1, 0, 2.0)]
    _record(tmp_path / "runs" / "run-pipe" / "recording.db", events)
    _ledger(tmp_path / "runs" / "run-pipe" / "ledger.db")
    log = cli("runs", "log", "run-pipe", cwd=tmp_path)
    replayed = cli("replay", "run-pipe", cwd=tmp_path)
    assert log.exit_code == 0 and replayed.exit_code == 0, (log.output, replayed.output)
    lines = log.stdout.splitlines()
    assert lines == replayed.stdout.splitlines()[1:]  # replay: a header line, then the same log
    assert all(line[:4] == "2026" and line[10] == "T" and line[23] == "Z" for line in lines), lines
    detail = [line for line in lines if "provisioning" in line]
    assert len(detail) == 1 and long.strip() in detail[0] and "2026-09-21T14:13:21.750Z  +   1.50s" in detail[0]
    shown = cli("ledger", "show", "run-pipe", cwd=tmp_path)  # a table to a pipe: the time column whole
    assert shown.exit_code == 0 and all(len(line) <= 200 for line in shown.stdout.splitlines())
    assert "time (UTC)" in shown.stdout


def test_a_ledger_or_run_that_is_not_there_is_bad_input_naming_the_path(tmp_path: Path) -> None:
    for command in ("show", "verify"):
        result = cli("ledger", command, "nosuch", "--json", cwd=tmp_path)
        assert result.exit_code == 2, result.output
        message = json.loads(result.stdout)["error"]["message"]
        assert str(tmp_path / "nosuch") in message and "no ledger or run 'nosuch'" in message
        assert message.count("does not exist") == 1, message  # one sentence, not the resolver's again
    missing = tmp_path / "gone" / "x.db"  # a path: named once, with no "under runs/" reading
    message = json.loads(cli("ledger", "verify", str(missing), "--json", cwd=tmp_path).stdout)["error"]["message"]
    assert message.count(str(missing)) == 2 and message.count("does not exist") == 1, message
    (tmp_path / "runs" / "run-a1").mkdir(parents=True)  # an ambiguous name keeps the resolver's words
    (tmp_path / "runs" / "run-a2").mkdir()
    for name in ("run-a1", "run-a2"):
        (tmp_path / "runs" / name / "settings.json").write_text("{}")
    ambiguous = cli("ledger", "verify", "run-a", "--json", cwd=tmp_path)
    assert ambiguous.exit_code == 2 and "ambiguous: run-a1, run-a2" in ambiguous.stdout, ambiguous.output
    (tmp_path / "runs" / "run-empty").mkdir(parents=True)
    (tmp_path / "runs" / "run-empty" / "settings.json").write_text("{}")
    result = cli("ledger", "verify", "run-empty", cwd=tmp_path)
    assert result.exit_code == 2 and "no ledger there" in result.output


# --- 35.2: runs ls / show read what the run recorded ----------------------------------------------------------
def _settings(folder: Path, **values: Any) -> None:
    (folder / "settings.json").write_text(json.dumps({"holders": 3, "rounds": 1, "model": "tiny", **values}))


def test_holders_and_model_are_what_the_run_recorded(tmp_path: Path) -> None:
    """A 2-holder inventory run was listed as 3 holders (the settings' default); a run from a GPT-2 124M file
    as ``model tiny``. The holders come from the run's RunStarted, the model from the file it started from."""
    import struct

    run = tmp_path / "runs" / "run-inv"
    _record(run / "recording.db", [ev.RunStarted(1.0, "inv", {"kind": "emulated", "sim": True}, ("north", "south"), 2),
                                   ev.RunCompleted(2.0, "inv", 2, 0, 1.0)])
    weights = tmp_path / "gpt2_124M.bin"  # llm.c's header of GPT-2 124M (the weights are not read)
    weights.write_bytes(struct.pack("<256i", 20240326, 3, 1024, 50257, 12, 12, 768, 50304, *([0] * 248)))
    _settings(run, transport="inventory", init_from=str(weights))
    shown = json.loads(cli("runs", "show", "run-inv", "--runs-dir", str(tmp_path / "runs"), "--json").stdout)
    assert shown["holders"] == 2 and shown["model"] == "gpt2 124M from gpt2_124M.bin"
    row = next(line for line in cli("runs", "ls", "--runs-dir", str(tmp_path / "runs")).stdout.splitlines()
               if "run-inv" in line)
    assert " 2 " in row and "gpt2 124M from gpt2_124M.bin" in row
    _settings(run, model="tiny", model_arch="llama", model_params=1_235_814_400, init_from="/models/Llama-3.2-1B")
    shown = json.loads(cli("runs", "show", "run-inv", "--runs-dir", str(tmp_path / "runs"), "--json").stdout)
    assert shown["model"] == "llama 1.2B from Llama-3.2-1B"  # what a Llama run records


def test_an_inventory_run_that_failed_before_it_started_lists_the_holders_it_reached_for(tmp_path: Path) -> None:
    """Operator walk (session 15): a one-holder inventory whose holder did not answer (AgentError, no RunStarted)
    was listed as 3 holders, the settings' default count, which an inventory does not use."""
    run = tmp_path / "runs" / "run-silent"
    _record(run / "recording.db", [ev.HolderStateChanged(1.0, "silent", "connecting", "127.0.0.1:47222"),
                                   ev.HolderStateChanged(4.0, "silent", "failed", "unreachable: connect timeout"),
                                   ev.RunFailed(4.1, "silent1", "silent: unreachable: connect timeout", "agent")])
    _settings(run, transport="inventory", holders=3, holders_file="/etc/gputravel/holders.toml")
    shown = json.loads(cli("runs", "show", "run-silent", "--runs-dir", str(tmp_path / "runs"), "--json").stdout)
    assert shown["status"] == "failed" and shown["holders"] == 1
    text = cli("runs", "show", "run-silent", "--runs-dir", str(tmp_path / "runs")).stdout
    assert "settings: 1 holder, 1 round" in text, text
    for side in run.glob("recording.db*"):  # nothing recorded: an inventory's count is unknown, not the default
        side.unlink()
    shown = json.loads(cli("runs", "show", "run-silent", "--runs-dir", str(tmp_path / "runs"), "--json").stdout)
    assert shown["holders"] is None


def test_a_visit_the_recording_shows_done_but_the_ledger_never_committed_says_resume_redoes_it(
        tmp_path: Path) -> None:
    """Operator walk (session 15): a run whose disk filled in visit 2's checkpoint showed visit 2 ``done`` in ``runs
    show`` (its recording's VisitCompleted), and ``--resume`` then trained it again: its progress was never
    committed (no ``visit-completed`` row). ``runs show`` says so for a run that ended without completing."""
    run = tmp_path / "runs" / "run-full"
    summary = ev.VisitSummary()
    _record(run / "recording.db", [
        ev.RunStarted(1.0, "full", {"kind": "emulated", "sim": True}, ("north", "south", "west"), 3),
        ev.PhaseStarted(2.0, 0, "north", "TRAIN", 1), ev.VisitCompleted(3.0, 0, "north", 1, summary),
        ev.PhaseStarted(4.0, 1, "south", "TRAIN", 2), ev.VisitCompleted(5.0, 1, "south", 2, summary),
        ev.PhaseStarted(6.0, 2, "west", "TRAIN", 3),  # then cancelled, and the disk was full: no final event
        ev.VisitCancelled(7.0, 2, "west", 3, "TRAIN", 4, True)])
    _settings(run, holders=3)
    with Ledger.open(run / "ledger.db", run_id="full") as ledger:
        ledger.append(kind="visit-completed", phase=None, holder="north", epoch=1, key_fp=None, nbytes=1,
                      duration_s=0.1, detail={"visit": 0}, state={"visits_done": 1})
    shown = cli("runs", "show", "run-full", "--runs-dir", str(tmp_path / "runs"))
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[1]: line for line in shown.stdout.splitlines() if line[:1] in "123"}
    assert "done, not committed" not in rows["north"] and " done " in rows["north"] + " "
    assert "done, not committed (--resume redoes it)" in rows["south"], shown.stdout
    assert "done" not in rows["west"] and "cancelled in TRAIN" in rows["west"] and "None" not in rows["west"]
    assert "died" in shown.stdout.splitlines()[0]


def test_a_resumed_run_that_completed_is_completed_with_its_history_as_resumed(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "run-res"
    platform = {"kind": "emulated", "sim": True}
    _record(run / "recording.db", [
        ev.RunStarted(1.0, "res", platform, ("alice", "bob"), 2),
        ev.PhaseStarted(1.5, 0, "alice", "TRAIN", 1),
        ev.RunFailed(2.0, "res", "cancelled (interrupted)", "cancelled"),
        ev.RunStarted(10.0, "res", platform, ("alice", "bob"), 2),  # `run --resume`: the same recording goes on
        ev.PhaseStarted(10.5, 0, "alice", "TRAIN", 2), ev.VisitCompleted(11.0, 0, "alice", 2, {}),
        ev.PhaseStarted(11.5, 1, "bob", "TRAIN", 3), ev.VisitCompleted(12.0, 1, "bob", 3, {}),
        ev.RunCompleted(13.0, "res", 2, 0, 3.0)])
    _settings(run)
    root = str(tmp_path / "runs")
    shown = json.loads(cli("runs", "show", "run-res", "--runs-dir", root, "--json").stdout)
    assert shown["status"] == "completed" and shown["error"] is None and shown["resumed"] == 1
    assert (shown["visits_done"], shown["visits_failed"]) == (2, 0)
    text = cli("runs", "show", "run-res", "--runs-dir", root).stdout
    assert "completed (resumed)" in text and "interrupted (resumed)" in text and "cancelled" not in text
    assert "error" not in text


def test_a_refused_visit_names_the_holders_claim_and_no_key(tmp_path: Path) -> None:
    from gputravel.console.view.model import RunState

    run = tmp_path / "runs" / "run-ref"
    events: list[ev.Event] = [
        ev.RunStarted(1.0, "ref", {"kind": "emulated", "sim": True}, ("alice",), 1),
        ev.PhaseStarted(1.5, 0, "alice", "PROVISION", 1),
        ev.VisitFailed(2.0, 0, "alice", 1, "PROVISION",
                       "agent alice: holder attestation refused: tdx-debug (no key released)", "agent"),
        ev.RunCompleted(3.0, "ref", 0, 1, 2.0)]
    _record(run / "recording.db", events)
    _settings(run, holders=1)
    state = RunState()
    for event in events:
        state.apply(event)
    (visit,) = state.visits.values()
    assert (visit.outcome, visit.error, visit.key_fp, visit.integrity_ok) == ("refused", "tdx-debug", None, None)
    text = cli("runs", "show", "run-ref", "--runs-dir", str(tmp_path / "runs")).stdout
    assert "refused (holder): tdx-debug" in text and "failed" not in text.split("outcome")[-1]


def test_latest_is_the_newest_run_started_whatever_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``runs/latest`` followed runs under ``runs/`` only: ``export latest`` took an older model than the run
    just made with ``--out``. Now every run claimed links it (an ``--out`` folder elsewhere by its absolute path),
    and a run that fails before its ledger gives the link back."""
    from gputravel.core.runfolder import RunClaim, resolve_run

    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    first = RunClaim(runs / "run-1", runs=runs, link_latest=True)
    first.claim()
    _ledger(runs / "run-1" / "ledger.db")
    assert resolve_run("latest", runs).folder == (runs / "run-1").resolve()
    elsewhere = RunClaim(tmp_path / "experiments" / "big", runs=runs, link_latest=True)
    elsewhere.claim()
    _ledger(tmp_path / "experiments" / "big" / "ledger.db")
    assert os.readlink(runs / "latest") == str(tmp_path / "experiments" / "big")
    assert resolve_run("latest", runs).folder == tmp_path / "experiments" / "big"
    failed = RunClaim(tmp_path / "experiments" / "quick", runs=runs, link_latest=True)
    failed.claim()
    failed.release_if_empty()  # failed before its ledger: nothing to audit, the link goes back
    assert resolve_run("latest", runs).folder == tmp_path / "experiments" / "big"
    assert "run-1" not in cli("runs", "show", "latest", "--json").stdout
    # runs ls lists the --out run outside runs/ too (runs/elsewhere.txt), by the path every run address takes;
    # the run refused before its ledger is not there
    listed = [r["name"] for r in json.loads(cli("runs", "ls", "--json").stdout)["runs"]]
    assert listed == ["run-1", str(tmp_path / "experiments" / "big")]
    assert (runs / "elsewhere.txt").stat().st_mode & 0o777 == 0o600
    shown = json.loads(cli("runs", "show", listed[1], "--json").stdout)
    assert shown["path"] == str(tmp_path / "experiments" / "big")
