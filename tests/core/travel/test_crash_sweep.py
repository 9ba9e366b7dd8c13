"""The slow crash sweeps (``-m slow``): the orchestrator killed at every phase of every visit, the device
service and the visiting holder's agent at every phase of visit 1, each resumed (or recovering by itself) to the
uninterrupted run's model. Their own module, so that pytest-xdist's workers (``make test``, ``--dist loadfile``)
run them beside test_crash.py's default faults instead of after them."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from crash_support import (
    RUN_IN_THE_DEFAULT_SUITE,
    check_end_state,
    crash_data,
    reference_run,
    resume,
    run_with_fault,
)
from helpers import HolderData

from gputravel.core.phases import VISIT_PHASES
from gputravel.core.travel.control import FaultPlan


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return crash_data(holder_data)


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return reference_run(data, tmp_path_factory)


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
