"""Every failure ends a run cleanly, and resume refuses what it cannot trust (issue 15).

Each failure is met as a user meets it: the real CLI in a subprocess with a fault flag, a real SSH server on
127.0.0.1 (the embedded asyncssh server the default run uses), real files with real permissions. Each test
asserts the exit code, the final ledger row, the JSON error where ``--json`` was given, and that nothing was lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import started

from gputravel.agents.deploy import HolderState, SshHolderLink
from gputravel.agents.fleet import EmbeddedSshServer
from gputravel.core.config import RunSettings
from gputravel.core.ledger import LedgerRow, read_rows, verify_ledger
from gputravel.core.travel.engine import TravelEngine

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
SMALL = ["--holders", "2", "--rounds", "2", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16",
         "--buffer-mib", "0.25", "--no-record"]


def gputravel(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputravel.console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def rows(out: Path, kind: str | None = None) -> list[LedgerRow]:
    return [r for r in read_rows(out / "ledger.db") if kind is None or r.kind == kind]


def json_error(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``--json`` error envelope on stdout, checked for its shape."""
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and set(doc["error"]) >= {"type", "message", "exit_code"}, doc
    assert doc["error"]["exit_code"] == proc.returncode
    assert "Traceback" not in proc.stdout + proc.stderr
    return dict(doc["error"])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for seed, holder in enumerate(("alice", "bob")):
        rng = random.Random(seed)
        (root / holder).mkdir()
        (root / holder / "text.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(12_000)))
    return root


# --- 1. an agent or its SSH session dies while the holder waits ------------------------------------
def test_agent_killed_while_waiting_goes_offline_reconnects_and_the_run_ends_0(data: Path, tmp_path: Path) -> None:
    """``--fault kill-agent@ATTEST:2`` on the default (embedded SSH) transport: alice's agent dies before its
    second visit; the holder goes offline, is reconnected and re-verified, and the visit is done by the new agent."""
    out = tmp_path / "run"
    proc = gputravel("run", "--data", str(data), *SMALL, "--out", str(out), "--json",
                     "--fault", "kill-agent@ATTEST:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert [(v["holder"], v["outcome"]) for v in report["visits"]] == [("alice", "done"), ("bob", "done")] * 2
    all_rows = rows(out)
    assert all_rows[-1].kind == "run-completed" and all_rows[-1].outcome == "ok"
    alice = [(r.kind, r.outcome) for r in all_rows if r.holder == "alice" and r.kind == "holder-state"]
    states = [s for _, s in alice]
    off = states.index("offline")
    # offline, then a fresh connection whose agent's hash is verified before it is ready for the key
    assert states[off:off + 4] == ["offline", "connecting", "verified", "ready"]
    assert states[off + 4:off + 6] == ["provisioning", "returned"]
    done = [r.detail["visit"] for r in all_rows if r.kind == "visit-completed"]
    assert sorted(done) == [0, 1, 2, 3]  # nothing lost, nothing twice
    assert verify_ledger(out / "ledger.db").ok


@pytest.fixture
def ssh(data: Path, tmp_path: Path) -> Iterator[EmbeddedSshServer]:
    (tmp_path / "ssh").mkdir()
    server = EmbeddedSshServer([(n, data / n) for n in ("alice", "bob")], workdir=tmp_path / "ssh")
    server.specs = server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def small(data: Path, out: Path, **kw: Any) -> RunSettings:
    base: dict[str, Any] = dict(holders=2, rounds=2, steps_per_visit=2, batch_size=4, seq_len=32, chunk_kib=16,
                                buffer_mib=0.25, data_dir=data, out_dir=out, allow_fault_injection=True,
                                transport="ssh")
    base.update(kw)
    return RunSettings(**base)


def witness_handoffs(ssh: EmbeddedSshServer, holder: str) -> int:
    path = ssh.workdir / "homes" / holder / ".gputravel" / "witness.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if json.loads(line).get("at") == "hand-off")


async def test_a_holder_whose_agent_does_not_come_back_gets_no_key_and_the_run_ends_partial(
        ssh: EmbeddedSshServer, data: Path, tmp_path: Path) -> None:
    """Alice's agent dies while she waits, and the bundle on her machine is changed behind our back: the
    reconnect refuses it (hash mismatch), so she is never verified-ready again and is handed no key; her
    visit fails by the retry policy, bob's go on, and the run ends partial (exit 9 on the CLI)."""
    out = tmp_path / "run"
    links = [SshHolderLink(s, max_reconnects=1) for s in ssh.specs]  # type: ignore[attr-defined]
    alice = links[0]
    async with started(small(data, out, fault="kill-agent@ATTEST:2"), links) as engine:
        def tamper(e: TravelEngine) -> None:  # as alice's second visit begins (the fault plan then kills her agent)
            if e.current is None or e.current.plan.index != 2:
                e.fault["ATTEST"] = tamper
                return
            (agent_dir,) = [d for d in (ssh.workdir / "homes" / "alice" / ".gputravel").glob("agent-*")
                            if ".part-" not in d.name]
            with open(agent_dir / "gputravel" / "agents" / "holder" / "agent.py", "a") as f:
                f.write("\n# changed behind the orchestrator's back\n")

        engine.fault["ATTEST"] = tamper
        report = await engine.run()
        keys_derived = (await asyncio.to_thread(engine.client.stats)).counters["handoffs"]

    outcomes = [(v["holder"], v["outcome"]) for v in report["visits"]]
    assert outcomes == [("alice", "done"), ("bob", "done"), ("alice", "failed"), ("bob", "done")]
    assert report["failed_visits"] == 1
    assert witness_handoffs(ssh, "alice") == 1  # her first visit's hand-off only: no key after she went down
    assert witness_handoffs(ssh, "bob") == 2
    assert alice.state in (HolderState.OFFLINE, HolderState.FAILED)
    failed = [r for r in rows(out, "visit-failed") if r.holder == "alice"]
    assert failed and all(r.detail["visit"] == 2 for r in failed)
    assert "hash mismatch" in failed[-1].detail["error"]
    assert {r.phase for r in failed} == {"HANDOFF"}  # failed before its window was opened
    # no provisioning key for alice once she went offline: no HANDOFF row (which names the key) for her
    # after it, and the device derived exactly one key per HANDOFF row
    all_rows = rows(out)
    off = next(i for i, r in enumerate(all_rows) if r.kind == "holder-state" and r.holder == "alice"
               and r.outcome == "offline")
    handoffs = [r for r in all_rows if r.kind == "phase" and r.phase == "HANDOFF"]
    assert not [r for r in all_rows[off:] if r.kind == "phase" and r.phase == "HANDOFF" and r.holder == "alice"]
    assert keys_derived == len(handoffs) == 3
    assert rows(out)[-1].kind == "run-completed" and rows(out)[-1].outcome == "partial"
    assert verify_ledger(out / "ledger.db").ok
