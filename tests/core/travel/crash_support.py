"""What the crash tests share (test_crash.py, the default suite's faults; test_crash_sweep.py, the slow sweeps): the
run they kill, the CLI they run it through, and the end state a resumed run must reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData

from gputravel.core.ledger import read_rows, verify_ledger
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


def crash_data(holder_data: HolderData) -> Path:
    """Two holders' text, the run every crash test kills."""
    return holder_data({"alice": 0, "bob": 1}, WORDS, 16_000, name="crashdata", newline=False)


def reference_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run's report, which every resumed run must equal."""
    out = tmp_path_factory.mktemp("ref") / "run"
    proc = gputravel("run", "--data", str(data), *ARGS, "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))
