"""RunFolder: the names as properties, a fleet's ranks, what makes a folder a run's, and the address and status
helpers built on it (real files in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputravel.core.errors import ConfigError
from gputravel.core.runfolder import (
    RunClaim,
    RunFolder,
    clear_status,
    read_status,
    resolve_run,
    write_status,
)


def test_a_fleets_ranks_come_in_rank_order_and_skip_what_is_not_a_rank(tmp_path: Path) -> None:
    fleet = RunFolder(tmp_path / "f")
    for gpu in (10, 2, 0):
        fleet.rank(gpu).path.mkdir(parents=True)
        fleet.rank(gpu).recording.write_bytes(b"")
    (fleet.path / "rank-x").mkdir()
    assert [n for n, _ in fleet.ranks()] == [0, 2, 10]
    assert [p.parent for _, p in fleet.rank_recordings()] == [fleet.rank(n).path for n in (0, 2, 10)]
    assert RunFolder.rank_of(fleet.rank(2).path) == 2 and RunFolder.rank_of(fleet.path / "rank-x") is None
    assert fleet.looks_like_fleet() and not fleet.is_fleet  # ranks recorded, fleet.json not written yet
    fleet.fleet_config.write_text("{}")
    assert fleet.is_fleet and fleet.is_run()


def test_a_folder_is_a_runs_only_when_a_run_wrote_into_it(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    assert not run.is_run()
    run.ledger.write_bytes(b"")
    assert run.is_run() and RunFolder.names_ledger(run.ledger) and not RunFolder.names_ledger(run.recording)


def test_every_name_lies_inside_the_folder(tmp_path: Path) -> None:
    run = RunFolder(tmp_path / "r")
    paths = [run.settings, run.ledger, run.recording, run.status_file, run.pid_file, run.report, run.fleet_config,
             run.cvm, run.device_log, run.keys, run.checkpoint_key, run.checkpoints, run.platform, run.vendor,
             run.receipts]
    assert len(set(paths)) == len(paths) and all(run.path in p.parents for p in paths)


def test_status_round_trips_and_clears(tmp_path: Path) -> None:
    write_status(tmp_path, "completed", run_id="r1")
    assert read_status(RunFolder(tmp_path))["status"] == "completed"
    assert json.loads(RunFolder(tmp_path).status_file.read_text())["final"] is True
    clear_status(tmp_path)
    assert read_status(tmp_path) == {}


def test_an_address_names_a_fleet_its_rank_recordings_and_its_ledger(tmp_path: Path) -> None:
    fleet = RunFolder(tmp_path / "runs" / "run-1")
    fleet.rank(0).path.mkdir(parents=True)
    fleet.rank(0).recording.write_bytes(b"")
    fleet.fleet_config.write_text("{}")
    address = resolve_run("run-1", tmp_path / "runs")
    assert address.fleet and address.recordings() == [(0, fleet.rank(0).recording)]
    assert address.ledger == fleet.ledger and address.run == fleet
    with pytest.raises(ConfigError, match="no run 'nope'"):
        resolve_run("nope", tmp_path / "runs")


def test_a_path_that_does_not_exist_is_named_as_missing_not_as_a_run_name(tmp_path: Path) -> None:
    """Operator walk (session 15): ``gputravel-console --replay /tmp/oqa/nothere.db`` said "no run
    '/tmp/oqa/nothere.db' under runs/", as if a path were a run's name; it names the path that is missing."""
    missing = tmp_path / "elsewhere" / "nothere.db"
    with pytest.raises(ConfigError) as raised:
        resolve_run(str(missing), tmp_path / "runs")
    assert raised.value.reason == (f"no run '{missing}': {missing} does not exist (a run folder, a recording, a "
                                 f"ledger, or a run's name under {tmp_path / 'runs'}/: gputravel runs ls lists them)")
    with pytest.raises(ConfigError, match=r"no run 'nope' under .*runs/ \(gputravel runs ls lists them\)$"):
        resolve_run("nope", tmp_path / "runs")  # a name stays a name


def test_a_claim_that_never_got_its_ledger_is_given_back(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    claim = RunClaim(runs / "run-a", runs=runs, link_latest=True)
    claim.claim()
    assert claim.out.is_dir() and RunFolder.latest(runs).is_symlink()
    claim.release_if_empty()
    assert not claim.out.exists() and not runs.exists()


def test_runs_started_at_once_in_one_folder_all_claim_and_latest_names_one_of_them(tmp_path: Path) -> None:
    """``runs/latest`` is replaced in one rename: unlinking and re-creating it let one of two runs started at once
    fail with "File exists" (seen with two test workers sharing a folder)."""
    import threading

    runs = tmp_path / "runs"
    errors: list[OSError] = []
    names = [f"run-{i:02d}" for i in range(64)]
    start = threading.Barrier(4)

    def claim_some(mine: list[str]) -> None:
        start.wait()
        for name in mine:
            try:
                RunClaim(runs / name, runs=runs, link_latest=True).claim()
            except OSError as exc:  # FileExistsError, when the link was made in two steps
                errors.append(exc)

    threads = [threading.Thread(target=claim_some, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    latest = RunFolder.latest(runs)
    assert latest.is_symlink() and latest.resolve().name in names
    assert sorted(p.name for p in runs.iterdir()) == sorted([*names, "latest"])  # no temporary link left behind


def test_a_ledger_file_named_directly_is_the_one_checked_even_beside_another_runs_ledger(tmp_path: Path) -> None:
    """A holder keeps copies of two runs' ledgers in one folder (``ledger.db`` and ``run-7.db``): naming
    ``run-7.db`` checks that file, not the ``ledger.db`` beside it (which made the folder look like a run folder
    and was checked instead, silently: session 15's walk). The run's recording still names its folder's ledger."""
    home = RunFolder(tmp_path / "home")
    home.path.mkdir()
    home.ledger.write_bytes(b"")
    other = home.path / "run-7.db"
    other.write_bytes(b"")
    assert resolve_run(str(other)).ledger == other
    assert resolve_run(str(home.ledger)).ledger == home.ledger
    home.recording.write_bytes(b"")
    assert resolve_run(str(home.recording)).ledger == home.ledger
