"""The workers' group over real gloo processes: a peer that dies is a named error that says what to do."""

from __future__ import annotations

import os
from typing import Any

import pytest

from gputravel.core.collectives.launch import WorkerContext, run_workers
from gputravel.core.errors import CollectiveError, WorkerError
from gputravel.core.fleet.group import FleetGroup

KEY = bytes(range(32))  # a test's fleet key (a real run's is agreed by attestation, in memory only)


def dying_peer_worker(ctx: WorkerContext) -> None:
    """One authenticated exchange, then rank 1 dies (SIGKILL-like) and rank 0 reports what its next one raised."""
    group = FleetGroup(key=KEY, timeout_s=60)
    assert group.gather({"rank": ctx.rank}) == [{"rank": 0}, {"rank": 1}]
    if ctx.rank == 1:
        os._exit(9)
    try:
        group.gather({"step": 1})
    except CollectiveError as exc:
        ctx.report(str(exc))


def test_a_worker_whose_peer_died_names_the_failure_and_says_resume_on_every_node() -> None:
    seen: dict[int, Any] = {}
    with pytest.raises(WorkerError) as info:
        run_workers(dying_peer_worker, 2, timeout=120, on_progress=lambda rank, text: seen.setdefault(rank, text))
    assert info.value.errors[1] == ("ProcessDied", "exit code 9")
    text = seen[0]
    assert text.startswith("CollectiveError: the fleet's worker group failed on rank 0: [")
    assert "another rank's worker or its node died" in text
    assert "--resume on every node, each with its own --out" in text
