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
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from crash_support import (
    AGENT_FAULT,
    ARGS,
    DEVICE_FAULTS,
    ORCHESTRATOR_FAULTS,
    check_end_state,
    crash_data,
    gputravel,
    reference_run,
    resume,
    run_with_fault,
)
from helpers import HolderData, descendants, still_alive

from gputravel.core.ledger import read_rows


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return crash_data(holder_data)


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return reference_run(data, tmp_path_factory)


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
            kids = descendants(orch.pid)
            cmds = list(kids.values())
            if any("gputravel.core.device" in c for c in cmds) and any("sshserver" in c for c in cmds) and \
                    sum("gputravel.agents.holder" in c and "python" in c.split()[0] for c in cmds) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the run never had its device, SSH server and 2 agents up: rc={orch.poll()} "
                        f"{(tmp_path / 'stderr').read_text()[-1500:]} children={kids}")
        time.sleep(0.5)
        kids = descendants(orch.pid)
        os.kill(orch.pid, signal.SIGKILL)
        assert orch.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while still_alive(kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert still_alive(kids) == {}, f"children outlived the killed orchestrator: {still_alive(kids)}"
    finally:
        for f in log:
            f.close()
        if orch.poll() is None:
            orch.kill()
            orch.wait()
        for pid in still_alive(kids):  # clean up whatever this test started, by pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
