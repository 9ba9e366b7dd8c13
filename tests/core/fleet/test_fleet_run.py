"""A fleet run end to end at N = 2: two torchrun ranks (gloo), each driving its own device service, three
local holders (H = 3 is not a multiple of N: one GPU idles in each round's last step)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import descendants, fleet_settings, still_alive, user_terminal, wait_for

from gputravel.console.entries import GPU_RANK, launch_gpus
from gputravel.core.bench.data import make_holders
from gputravel.core.errors import ConfigError, FleetDeviceLostError, GpuTravelError
from gputravel.core.fleet.rank import FleetOptions
from gputravel.core.fleet.run import Rendezvous, torchrun_command, verify_fleet
from gputravel.core.ledger import read_rows, verify_ledger


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_holders(tmp_path_factory.mktemp("holders"), 3, 40_000)


@pytest.fixture(scope="module")
def secure(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return launch_gpus(fleet_settings(data, tmp_path_factory.mktemp("secure")), FleetOptions(gpus=2, timeout_s=120),
                        quiet=True)


def test_replicas_stay_identical_after_every_step(secure: dict) -> None:
    fleet = secure["fleet"]
    assert fleet["gpus"] == 2 and fleet["rounds"] == 1 and fleet["steps"] == 2
    assert fleet["replica_digests_equal"] is True
    assert [s["digests_equal"] for s in fleet["step_log"]] == [True, True]
    assert len({s["digest"] for s in fleet["step_log"]}) == 2  # the model moved in both steps
    assert sorted(fleet["step_log"][1]["weights"]) == [0.0, 1.0]  # H=3, N=2: one GPU idles (weight 0)


def test_every_visit_names_its_device_and_each_device_its_own_epochs(secure: dict) -> None:
    visits = secure["visits"]
    assert len(visits) == 3 and all(v["outcome"] == "done" for v in visits)
    assert {v["device"] for v in visits} == {"emu-gpu-0", "emu-gpu-1"}
    for device in ("emu-gpu-0", "emu-gpu-1"):
        epochs = [v["epoch"] for v in visits if v["device"] == device]
        assert epochs == list(range(1, len(epochs) + 1))  # each device counts its own epochs from 1
    step0 = [v["holder"] for v in visits if v["step"] == 0]
    assert len(step0) == len(set(step0)) == 2  # two GPUs, two different holders


def test_allreduce_is_sealed_and_counted(secure: dict) -> None:
    ar = secure["fleet"]["allreduce"]
    assert ar["variant"] == "secure_pipelined" and ar["sealed"] is True
    assert ar["calls"] >= 2 * 2 * 2  # 2 GPUs x 2 steps x 2 optimizer steps, at least a bucket each
    assert ar["seconds"] > 0
    peers = [d["join"]["peers"] for d in secure["fleet"]["devices"]]
    assert peers[0]["right"].startswith("emu-gpu-1:") and peers[1]["left"].startswith("emu-gpu-0:")


def test_ledgers_carry_the_device_and_verify(secure: dict) -> None:
    assert secure["ledger"]["verified"] is True
    assert verify_ledger(Path(secure["ledger"]["path"])).ok
    for rank in secure["ledger"]["ranks"]:
        rows = list(read_rows(Path(rank["path"])))
        tagged = [r for r in rows if r.kind in ("phase", "fleet-step", "fleet-joined")]
        assert tagged and all(r.detail["device"] == f"emu-gpu-{rank['gpu']}" for r in tagged)
    fleet_rows = list(read_rows(Path(secure["ledger"]["path"])))
    heads = [r.detail["ledger_head"] for r in fleet_rows if r.kind == "fleet-device"]
    assert heads == [f"{r['rows']}:{r['head']}" for r in secure["ledger"]["ranks"]]


def test_a_failing_holder_is_handled_and_the_step_still_reduces_with_lora(data: Path, tmp_path: Path) -> None:
    # a LoRA fleet (`run --gpus 2 --lora-rank 4`, issue 32): the ring reduces the adapters' gradients alone (the
    # frozen base has none), an idle rank's zero batch included, and the replicas stay equal
    report = launch_gpus(fleet_settings(data, tmp_path / "f", fault="kill-agent@PROVISION:1", lora_rank=4),
                          FleetOptions(gpus=2, timeout_s=120), quiet=True)
    assert report["training"]["model"]["lora"] == {"rank": 4, "alpha": 4.0, "targets": ["c_attn"]}
    failed = [v for v in report["visits"] if v["outcome"] == "failed"]
    assert [(v["visit"], v["failed_phase"]) for v in failed] == [(1, "PROVISION")]
    assert report["failed_visits"] == 1
    step0 = report["fleet"]["step_log"][0]
    assert sorted(step0["weights"]) == [0.0, 1.0]  # reduced over the rank that trained
    assert report["fleet"]["replica_digests_equal"] is True
    assert report["ledger"]["verified"] is True
    out = tmp_path / "f"
    assert verify_fleet(out).ok  # `gputravel ledger verify <out>`: the fleet ledger and every rank's
    with sqlite3.connect(out / "rank-1" / "ledger.db") as db:
        db.execute("UPDATE events SET outcome = 'tampered' WHERE seq = 3")
    broken = verify_fleet(out)
    assert not broken.ok and (broken.reason or "").startswith("rank-1/ledger.db")


@pytest.mark.slow  # tests/core/fleet/test_fleet_ddp.py proves the same on the device side in the default suite
def test_plain_all_reduce_with_the_same_seed_trains_the_same(data: Path, secure: dict, tmp_path: Path) -> None:
    plain = launch_gpus(fleet_settings(data, tmp_path / "p"), FleetOptions(gpus=2, variant="plain", timeout_s=120),
                         quiet=True)
    assert plain["fleet"]["allreduce"]["sealed"] is False
    a = [v["loss_last"] for v in secure["visits"]]
    b = [v["loss_last"] for v in plain["visits"]]
    assert a == pytest.approx(b, rel=1e-4)


def test_torchrun_command_passes_rendezvous_options_through(tmp_path: Path) -> None:
    cmd = torchrun_command(tmp_path / "fleet.json", gpus=4, entry=GPU_RANK,
                           rdzv=Rendezvous(nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="f7", max_restarts=1))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    text = " ".join(cmd)
    for part in ("--nnodes 2", "--nproc-per-node 2", "--rdzv-backend c10d", "--rdzv-endpoint 10.0.0.1:29400",
                 "--rdzv-id f7", "--max-restarts 1", "-m gputravel.console.cli.fleet_rank"):
        assert part in text
    with pytest.raises(ConfigError):
        torchrun_command(tmp_path / "fleet.json", gpus=3, rdzv=Rendezvous(nnodes=2), entry=GPU_RANK)
    with pytest.raises(ConfigError):
        FleetOptions(gpus=2, variant="gloo_tls")
    assert json.loads(json.dumps(FleetOptions(gpus=2).to_dict()))["gpus"] == 2


@pytest.mark.slow
def test_a_device_lost_for_good_stops_the_fleet_resumably(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "lost"
    with pytest.raises(FleetDeviceLostError):
        launch_gpus(fleet_settings(data, out, fault="kill-device@TRAIN:1"), FleetOptions(gpus=2, timeout_s=120),
                     quiet=True)
    stopped = json.loads((out / "report.json").read_text())
    assert stopped["error"]["code"] == "fleet-device-lost"
    assert stopped["ledger"]["verified"] is True  # every rank's chain, and the fleet's, still prove the run
    resumed = launch_gpus(fleet_settings(data, out, resume=True), FleetOptions(gpus=2, timeout_s=120), quiet=True)
    assert resumed["fleet"]["replica_digests_equal"] is True
    assert {v["visit"] for v in resumed["visits"] if v["outcome"] == "done"} == {0, 1, 2}


@pytest.mark.slow
def test_a_device_lost_after_the_step_all_reduce_leaves_every_rank_resumable(data: Path, tmp_path: Path) -> None:
    """Rank 1's device dies at SCRUB of step 0, after the all-reduce: rank 0 completed its visit (its ROTATE wrote
    its checkpoint), but the step was never agreed, so neither rank's progress may name that checkpoint
    (session 15: rank 0's state named visit 0's number and `--resume` refused its honest ledger, exit 8)."""
    out = tmp_path / "lost-late"
    with pytest.raises(FleetDeviceLostError):
        launch_gpus(fleet_settings(data, out, fault="kill-device@SCRUB:1"), FleetOptions(gpus=2, timeout_s=120),
                    quiet=True)
    resumed = launch_gpus(fleet_settings(data, out, resume=True), FleetOptions(gpus=2, timeout_s=120), quiet=True)
    assert resumed["fleet"]["replica_digests_equal"] is True
    assert {v["visit"] for v in resumed["visits"] if v["outcome"] == "done"} == {0, 1, 2}


#: the launcher ``gputravel run --gpus 2`` runs (``launch_gpus``), as its own process, on the given settings
LAUNCHER = """
import json, sys
from gputravel.console.entries import launch_gpus
from gputravel.core.config import RunSettings
from gputravel.core.fleet.rank import FleetOptions
launch_gpus(RunSettings.from_dict(json.loads(sys.argv[1])), FleetOptions(gpus=2, timeout_s=120), quiet=True)
"""


def _trained(out: Path) -> bool:
    """A rank has finished TRAIN of its first visit (step 0's all-reduce done or under way)."""
    for ledger in out.glob("rank-*/ledger.db"):
        with contextlib.suppress(GpuTravelError, sqlite3.Error):
            if any(r.kind == "phase" and r.phase == "TRAIN" for r in read_rows(ledger)):
                return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(1200)  # up to three fleet runs (the reference, when this test runs alone): 7 min at load 10
def test_a_launcher_killed_outright_leaves_nothing_running_and_resume_reaches_the_reference(
        data: Path, secure: dict, tmp_path: Path) -> None:
    """The launcher's process alone is SIGKILLed (kill -9, the OOM killer, a job scheduler) once a rank has trained
    step 0: torchrun, both workers, their device services and their agents end with it within seconds (before,
    the workers, in sessions of their own, went on for 25-35 s, one through a whole hand-off, until a write to
    the dead launcher's pipe failed), and ``--resume`` ends with the uninterrupted fleet's model."""
    out = tmp_path / "k"
    log = (tmp_path / "launcher.log").open("wb")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(fleet_settings(data, out).to_dict())],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        assert wait_for(lambda: _trained(out) or launcher.poll() is not None, timeout=400, interval=0.2)
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-2000:]
        tree = descendants(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=10) == -signal.SIGKILL
        for role, count in (("torch.distributed.run", 1), ("gputravel.console.cli.fleet_rank", 2),
                            ("gputravel.core.fleet.device", 2), ("gputravel.agents.holder", 2)):
            assert sum(role in cmd for cmd in tree.values()) >= count, f"no {role} at the kill: {tree}"
        assert wait_for(lambda: not still_alive(tree), timeout=15, interval=0.1), \
            f"outlived the killed launcher: {still_alive(tree)}"
    finally:
        log.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in still_alive(tree):  # whatever this test started, by pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    resumed = launch_gpus(fleet_settings(data, out, resume=True), FleetOptions(gpus=2, timeout_s=120), quiet=True)
    assert resumed["fleet"]["replica_digests_equal"] is True and resumed["failed_visits"] == 0
    assert resumed["ledger"]["verified"] is True
    assert resumed["training"]["model_digest"] == secure["training"]["model_digest"]


@pytest.mark.slow
def test_console_gpus_follows_every_gpu_while_the_fleet_runs(data: Path, tmp_path: Path) -> None:
    from gputravel.console.tui.fleet_console import watch_fleet
    from gputravel.console.tui.fleet_view import FleetRecording

    seen: list[dict[str, object]] = []

    class _App:
        def __init__(self, **kw: object) -> None:
            seen.append(kw)

        def run(self) -> None:  # opened at once (issue 25.10); a follower picks the ranks up as they start
            fleet = FleetRecording(Path(str(seen[-1]["replay"])), follow=True, gpus=2)
            for _ in range(1200):
                if 0 in fleet.rank_files():
                    break
                time.sleep(0.1)
            seen.append({"gpus": fleet.gpus, "rank-0": 0 in fleet.rank_files()})

    settings = fleet_settings(data, tmp_path / "c")
    watch_fleet(settings, gpus=2, make_app=_App, theme="dark")
    assert seen[0]["follow"] is True and seen[0]["readonly"] is True
    assert seen[0]["replay"] == tmp_path / "c" and seen[1] == {"gpus": 2, "rank-0": True}
    assert json.loads((tmp_path / "c" / "report.json").read_text())["fleet"]["replica_digests_equal"] is True


def test_a_tampered_ring_hop_fails_the_step_on_every_rank_and_replicas_stay_equal(data: Path,
                                                                                 tmp_path: Path) -> None:
    report = launch_gpus(fleet_settings(data, tmp_path / "t"), FleetOptions(gpus=2, timeout_s=120, ring_fault="flip@0"),
                          quiet=True)
    visits = report["visits"]
    assert all(v["outcome"] == "failed" and v["failed_phase"] == "TRAIN" for v in visits)
    assert {(v["error"] or "").split(":")[0] for v in visits} <= {"TagError", "CollectiveAbortedError"}
    assert any((v["error"] or "").startswith("TagError") for v in visits)  # the receiver of the flipped hop
    assert report["fleet"]["replica_digests_equal"] is True  # every replica was put back, together
    assert len({s["digest"] for s in report["fleet"]["step_log"]}) == 1  # and never moved
    assert report["ledger"]["verified"] is True


TORCHRUN_KILLED_RANK_1 = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gputravel.console.cli.fleet_rank FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_04:00:00
  host      : ci
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_a_survivors_collective_error_after_its_peer_was_killed_names_the_kill() -> None:
    """Rank 1 was SIGKILLed; rank 0 saw its gloo socket close before torchrun's SIGTERM reached it and reported a
    collective error. The job's failure is the kill, named as torchrun saw it, whichever came first (CI at load
    saw this order); the survivor's words are kept. A rank's own non-collective refusal still wins, and a
    collective error with no killed rank stays a collective error."""
    from gputravel.core.errors import CollectiveError, ReplicaDivergedError, WorkerError
    from gputravel.core.fleet.failure import RankError, job_failure

    saw = RankError("collective", "the fleet's worker group failed: [gloo] Connection closed by peer")
    error = job_failure(1, TORCHRUN_KILLED_RANK_1, errors=[saw], silent=[1])
    assert isinstance(error, WorkerError) and error.exit_code == 10
    assert "rank 1 failed first (killed by signal 9)" in error.reason and "Connection closed by peer" in error.reason
    # torchrun's SIGTERM came first: no report from either, the same named error
    quiet = job_failure(1, TORCHRUN_KILLED_RANK_1, errors=[], silent=[0, 1])
    assert isinstance(quiet, WorkerError) and "rank 1 failed first (killed by signal 9)" in quiet.reason
    refused = RankError("replica-diverged", "rank 0's digest differs")
    assert isinstance(job_failure(1, TORCHRUN_KILLED_RANK_1, errors=[refused], silent=[1]), ReplicaDivergedError)
    # no account from torchrun (it never wrote one): the survivor's own error stands
    assert isinstance(job_failure(1, "", errors=[saw], silent=[1]), CollectiveError)
    # the killed rank had written its own report: its words are not a kill's consequence
    assert isinstance(job_failure(1, TORCHRUN_KILLED_RANK_1, errors=[saw], silent=[]), CollectiveError)


@pytest.mark.slow
def test_a_rank_killed_in_a_run_shown_on_a_terminal_is_named_as_the_kill(data: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``gputravel run --gpus 2`` as a user runs it: not quiet, stderr a terminal (a pseudo-terminal the test reads
    as a terminal emulator would). Rank 1 is SIGKILLed at its TRAIN (the fault of
    test_fleet_attacks.py::test_a_rank_killed_mid_round_stops_the_other_with_a_named_error_and_resume_finishes,
    which runs quiet): the job's error names the kill, as in a quiet run, and the terminal showed the ranks'
    progress and torchrun's own account as they came."""
    from gputravel.core.errors import WorkerError

    with user_terminal() as (tty, seen):
        monkeypatch.setattr("sys.stderr", tty)
        with pytest.raises(WorkerError) as caught:
            launch_gpus(fleet_settings(data, tmp_path / "k", fault="kill-orchestrator@TRAIN:1"),
                        FleetOptions(gpus=2, timeout_s=120))
        monkeypatch.undo()
    assert caught.value.exit_code == 10 and "torchrun job exited" in caught.value.reason, caught.value
    assert "rank 1 failed first (killed by signal 9)" in caught.value.reason
    shown = seen.decode(errors="replace")
    assert "[gpu 0] attested emu-gpu-0 ok" in shown and "[gpu 1] attested emu-gpu-1 ok" in shown, shown[-3000:]
    assert "Root Cause (first observed failure)" in shown  # torchrun's account reached the terminal as well


def test_a_malformed_rank_report_is_a_named_error_naming_the_file(tmp_path: Path) -> None:
    """The reports are read once, where the launcher reads them, into a typed error (code, reason); a report that
    is not what a rank writes is a RankReportError (exit 10) naming the file, never a KeyError or a JSON traceback."""
    from gputravel.core.errors import CollectiveError, RankReportError
    from gputravel.core.fleet.failure import RankError, read_report

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"error": {"code": "collective", "reason": "peer closed"}, "gpu": {"rank": 1}}))
    read = read_report(report)
    assert read.error == RankError("collective", "peer closed") and read.data["gpu"] == {"rank": 1}
    assert isinstance(read.error.to_error(), CollectiveError) and read.error.to_error().reason == "peer closed"
    report.write_text(json.dumps({"visits": [], "failed_visits": 0}))
    assert read_report(report).error is None
    for bad, says in [('{"error": {"code": "collec', "not a report"),  # a rank killed while it wrote
                      ("[1, 2]", "a JSON object"),
                      ('{"error": "collective"}', "not an object with code and reason"),
                      ('{"error": {"code": 7, "reason": "x"}}', "non-empty string code"),
                      ('{"error": {"code": "collective"}}', "string reason")]:
        report.write_text(bad)
        with pytest.raises(RankReportError) as caught:
            read_report(report)
        assert str(report) in caught.value.reason and says in caught.value.reason, caught.value.reason
        assert caught.value.exit_code == 10
    with pytest.raises(RankReportError):
        read_report(tmp_path / "missing.json")
