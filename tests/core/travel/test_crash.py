"""Crash safety: kill -9 any process at a phase boundary or mid-phase, resume, lose nothing.

Each case runs the real CLI in a subprocess with a fault plan (the engine's fault-injection hook
kills the orchestrator itself, the device service or a holder agent at the chosen point), then
``--resume`` where the orchestrator died, and checks the end state against an uninterrupted run with
the same seed: the final model digest is equal bit for bit (CPU), every visit is completed exactly
once, no hand-off epoch repeats, and the ledger verifies.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData, live_processes

from gputravel.core.ledger import read_rows, verify_ledger
from gputravel.core.phases import VISIT_PHASES
from gputravel.core.travel.control import FaultPlan

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls sing softly at night".split()
ARGS = ["--holders", "2", "--rounds", "1", "--steps-per-visit", "3", "--batch-size", "4", "--seq-len", "32",
        "--chunk-kib", "16", "--buffer-mib", "0.25", "--transport", "local"]


#: One torch thread in every run here, reference and resumed alike. With two, a resumed run under load ended
#: 1 ulp away from the uninterrupted one three times (ROTATE-0, TRAIN-1, PROVISION:1+0.01): its retrained visit's
#: last loss was bit for bit the one-thread value, even with the device's threads pinned at start (pin_threads).
#: The cause is open (docs/checkpoints.md, "Known limits"); these tests check what a resume restores and repeats,
#: which one thread makes exact.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def gputravel(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return holder_data({"alice": 0, "bob": 1}, WORDS, 16_000, name="crashdata", newline=False)


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ref") / "run"
    proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def check_end_state(out: Path, report: dict[str, Any], reference: dict[str, Any]) -> None:
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]
    assert report["training"]["steps"] == reference["training"]["steps"]
    rows = list(read_rows(out / "ledger.db"))
    completed = Counter(r.detail["visit"] for r in rows if r.kind == "visit-completed")
    assert completed == Counter({0: 1, 1: 1}), completed  # each holder part trained exactly once
    epochs = [r.epoch for r in rows if r.kind == "phase" and r.phase == "HANDOFF"]
    assert len(epochs) == len(set(epochs)), f"an epoch was reused: {epochs}"
    assert verify_ledger(out / "ledger.db").ok


def run_with_fault(data: Path, out: Path, fault: str) -> subprocess.CompletedProcess[str]:
    return gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json", "--fault", fault)


def resume(out: Path) -> dict[str, Any]:
    proc = gputravel("run", "--resume", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


#: The faults the default suite runs (kill-orchestrator@CHECKPOINT:0, mid background checkpoint of visit 0, is
#: test_a_kill_during_a_background_checkpoint_commits_nothing_it_held's). The slow sweeps skip these exact runs:
#: the default suite's tests assert all the sweep would (and more) on the same fault, and CI runs both tiers.
ORCHESTRATOR_FAULTS = [
    "kill-orchestrator@ROTATE:0",          # boundary: trained, not yet committed -> the visit is redone
    "kill-orchestrator@PROVISION:1+0.01",  # mid-phase: chunks in flight
    "kill-orchestrator@TRAIN:0+0.1",       # mid-phase: the device is training
]
DEVICE_FAULTS = ["kill-device@TRAIN:0+0.05", "kill-device@PROVISION:1"]
AGENT_FAULT = "kill-agent@PROVISION:1"
RUN_IN_THE_DEFAULT_SUITE = {FaultPlan.parse(f) for f in [*ORCHESTRATOR_FAULTS, *DEVICE_FAULTS, AGENT_FAULT,
                                                          "kill-orchestrator@CHECKPOINT:0"]}


@pytest.mark.parametrize("fault", ORCHESTRATOR_FAULTS)
def test_orchestrator_killed_then_resumed_loses_and_repeats_nothing(data: Path, tmp_path: Path, fault: str,
                                                                    reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    proc = run_with_fault(data, out, fault)
    assert proc.returncode == -9, f"the orchestrator was not killed: rc={proc.returncode} {proc.stderr[-500:]}"
    report = resume(out)
    check_end_state(out, report, reference)
    assert any(r.kind == "resumed" for r in read_rows(out / "ledger.db"))


def test_a_kill_during_a_background_checkpoint_commits_nothing_it_held(data: Path, tmp_path: Path,
                                                                       reference: dict[str, Any]) -> None:
    """kill -9 once visit 0's checkpoint has its first chunk on disk (written in the background while visit 1
    goes on): visit 0 is not committed (no row, the resume point is the initial checkpoint), no partial file
    carries a checkpoint's name, and --resume redoes it and reaches the uninterrupted run's model."""
    out = tmp_path / "run"
    proc = run_with_fault(data, out, "kill-orchestrator@CHECKPOINT:0")
    assert proc.returncode == -9, proc.stderr[-500:]
    rows = list(read_rows(out / "ledger.db"))
    assert not [r for r in rows if r.kind == "visit-completed"]
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == ["ckpt-000000.gtc"]
    check_end_state(out, resume(out), reference)
    assert any(r.kind == "resumed" for r in read_rows(out / "ledger.db"))


def test_checkpoints_every_second_visit_resume_exactly(data: Path, tmp_path: Path,
                                                       reference: dict[str, Any]) -> None:
    """--checkpoint-every 2: visit 0 has no checkpoint of its own, so a kill in visit 1 loses both (neither is
    committed) and --resume redoes both; only the initial and the last checkpoint were written."""
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json", "--checkpoint-every", "2",
                     "--fault", "kill-orchestrator@SCRUB:1")
    assert proc.returncode == -9, proc.stderr[-500:]
    assert not [r for r in read_rows(out / "ledger.db") if r.kind == "visit-completed"]
    report = resume(out)
    check_end_state(out, report, reference)
    assert report["checkpoints"]["every"] == 2 and report["checkpoints"]["kept"] == [0, 2]


@pytest.mark.parametrize("fault", DEVICE_FAULTS)
def test_device_killed_mid_run_is_restarted_from_the_sealed_checkpoint(data: Path, tmp_path: Path, fault: str,
                                                                       reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    proc = run_with_fault(data, out, fault)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    rows = list(read_rows(out / "ledger.db"))
    # the previous visit's checkpoint is written in the background: when the device died before it was
    # durable, its snapshot died too, and that visit is undone and redone as well (never committed twice)
    undone = [r.detail["visit"] for r in rows if r.kind == "visit-undone"]
    assert report["device_restarts"] == 1 and report["retried_visits"] == 1 + len(undone)
    assert undone in ([], [0])  # a kill that lands after TRAIN:0 ended (fast steps) may undo visit 0 too
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    check_end_state(out, report, reference)
    restarted = [r for r in rows if r.kind == "device-restarted"]
    assert len(restarted) == 1 and restarted[0].detail["restored_checkpoint"] is not None


def test_agent_killed_mid_transfer_is_redone_with_a_restarted_agent(data: Path, tmp_path: Path,
                                                                    reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    proc = run_with_fault(data, out, AGENT_FAULT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    visit = report["visits"][1]
    assert visit["outcome"] == "done" and visit["attempts"] == 2 and "PROVISION" in visit["earlier_failures"][0]
    check_end_state(out, report, reference)
    failed = [r for r in read_rows(out / "ledger.db") if r.kind == "visit-failed"]
    assert len(failed) == 1 and failed[0].detail["scrub_verified"] is True


def test_resumed_run_never_reuses_the_epoch_of_the_interrupted_visit(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_with_fault(data, out, "kill-orchestrator@PROVISION:0+0.01")
    assert proc.returncode == -9
    before = max(r.epoch for r in read_rows(out / "ledger.db") if r.epoch is not None)
    resume(out)
    rows = list(read_rows(out / "ledger.db"))
    resumed_at = next(r.seq for r in rows if r.kind == "resumed")
    after = [r.epoch for r in rows if r.seq > resumed_at and r.kind == "phase" and r.phase == "HANDOFF"]
    assert after and min(after) > before


PHASES = [str(p) for p in VISIT_PHASES]


def sweep_delays(fault: Callable[[float], str], inside: float, turn: int) -> list[float]:
    """The kill points of one sweep case: the phase's boundary (0.0) and a point ``inside`` it, less a fault the
    default suite already runs (``RUN_IN_THE_DEFAULT_SUITE``). ``make test`` (CI's 90 minutes) takes one of the
    two by turns, so every phase is killed at its boundary in one case and inside in its neighbour;
    ``GPUTRAVEL_CRASH_SWEEP=full`` takes both everywhere."""
    points = [d for d in (0.0, inside) if FaultPlan.parse(fault(d)) not in RUN_IN_THE_DEFAULT_SUITE]
    if os.environ.get("GPUTRAVEL_CRASH_SWEEP") == "full" or len(points) < 2:
        return points
    return [points[turn % 2]]


@pytest.mark.slow
@pytest.mark.parametrize("visit", [0, 1])
@pytest.mark.parametrize("phase", PHASES)
def test_kill_point_sweep(data: Path, tmp_path: Path, reference: dict[str, Any], phase: str, visit: int) -> None:
    """Every phase of every visit, killed at its boundary or a random point inside it (``sweep_delays``: by turns,
    both with ``GPUTRAVEL_CRASH_SWEEP=full``; slow: ``-m slow``); a fault
    the default suite already runs (``RUN_IN_THE_DEFAULT_SUITE``) is not run twice."""
    turn = PHASES.index(phase) + visit
    for delay in sweep_delays(lambda d: f"kill-orchestrator@{phase}:{visit}+{d}",
                              random.Random(f"{phase}{visit}").uniform(0.001, 0.2), turn):
        fault = f"kill-orchestrator@{phase}:{visit}+{delay}"
        out = tmp_path / f"run-{delay:.3f}"
        proc = run_with_fault(data, out, fault)
        if proc.returncode == 0:  # the phase ended before the timer fired: nothing to resume
            check_end_state(out, json.loads(proc.stdout), reference)
            continue
        assert proc.returncode == -9
        check_end_state(out, resume(out), reference)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["device", "agent"])
@pytest.mark.parametrize("phase", PHASES)
def test_device_and_agent_kill_sweep(data: Path, tmp_path: Path, reference: dict[str, Any], phase: str,
                                     target: str) -> None:
    """``kill -9`` of the device service or of the visiting holder's agent at every phase of visit 1, at the
    boundary and at a random point inside; the run recovers by itself (slow: ``-m slow``). A fault the default
    suite already runs (``RUN_IN_THE_DEFAULT_SUITE``) is not run twice."""
    turn = PHASES.index(phase) + (target == "agent")
    for delay in sweep_delays(lambda d: f"kill-{target}@{phase}:1+{d}",
                              random.Random(f"{target}{phase}").uniform(0.001, 0.2), turn):
        fault = f"kill-{target}@{phase}:1+{delay}"
        out = tmp_path / f"run-{delay:.3f}"
        proc = run_with_fault(data, out, fault)
        assert proc.returncode == 0, proc.stderr[-2000:]
        check_end_state(out, json.loads(proc.stdout), reference)


def _descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> command line."""
    procs = live_processes()
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    cmd = {p.pid: p.cmd for p in procs}
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = cmd.get(pid, "?")
        todo.extend(children.get(pid, []))
    return found


def _alive(pids: dict[int, str]) -> dict[int, str]:
    live = {p.pid: p.cmd for p in live_processes()}
    return {pid: c for pid, c in pids.items() if live.get(pid) == c}  # same pid and command: not a reused pid


def test_killed_orchestrator_leaves_no_child_behind(data: Path, tmp_path: Path) -> None:
    """``kill -9`` of a real ``gputravel run`` (SSH transport: the embedded SSH server, agents under it, the
    device service) while it is paused before the first hand-off: within seconds no process it started is
    left (each child holds the orchestrator's pipes, and a device service on a real GPU holds its memory)."""
    out = tmp_path / "run"
    args = [a for a in ARGS if a not in ("--transport", "local")]
    log = (tmp_path / "stdout").open("wb"), (tmp_path / "stderr").open("wb")
    orch = subprocess.Popen([sys.executable, "-m", "gputravel.console.cli", "run", "--data", str(data), *args,
                             "--transport", "ssh", "--out", str(out), "--break-before", "HANDOFF"],
                            stdout=log[0], stderr=log[1], stdin=subprocess.DEVNULL, start_new_session=True)
    kids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and orch.poll() is None:
            kids = _descendants(orch.pid)
            cmds = list(kids.values())
            if any("gputravel.core.device" in c for c in cmds) and any("sshserver" in c for c in cmds) and \
                    sum("gputravel.agents.holder" in c and "python" in c.split()[0] for c in cmds) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the run never had its device, SSH server and 2 agents up: rc={orch.poll()} "
                        f"{(tmp_path / 'stderr').read_text()[-1500:]} children={kids}")
        time.sleep(0.5)
        kids = _descendants(orch.pid)
        os.kill(orch.pid, signal.SIGKILL)
        assert orch.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(kids) == {}, f"children outlived the killed orchestrator: {_alive(kids)}"
    finally:
        for f in log:
            f.close()
        if orch.poll() is None:
            orch.kill()
            orch.wait()
        for pid in _alive(kids):  # clean up whatever this test started, by pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
