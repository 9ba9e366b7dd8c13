"""A fleet over two nodes that share nothing (issue 36), on one machine: two torchrun invocations with
``--nnodes 2``, rendezvous on 127.0.0.1, each node its own ``--out`` (0700; the same system user here, two users in
test_fleet_two_users.py). The SIM vendors' PKI is exported once and installed by each node; the fleet key is
agreed by the workers' attested CVMs over the store and is never written to either folder."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import fleet_settings

from gputravel.console.entries import launch_gpus
from gputravel.core.errors import AttestationError, GpuTravelError
from gputravel.core.fleet.pki import export_sim_pki
from gputravel.core.fleet.rank import FleetOptions
from gputravel.core.fleet.run import Rendezvous
from gputravel.core.ledger import read_rows, verify_ledger
from gputravel.core.runfolder.folder import RunFolder

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gputravel.core.bench.data import make_holders

    return make_holders(tmp_path_factory.mktemp("holders"), 2, 30_000)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(data: Path, root: Path, *, inject: dict[int, str] | None = None, fault: str | None = None,
               resume: bool = False, max_restarts: int = 0) -> list[dict[str, Any] | Exception]:
    """Two nodes of one job (1 GPU each, two rounds over two holders): each node's report, or its error."""
    pki = root / "sim-pki.json"
    if not pki.exists():
        export_sim_pki(pki)
    rdzv_id, port = f"nodes-{uuid.uuid4().hex[:8]}", _port()
    results: list[dict[str, Any] | Exception] = [RuntimeError("never ran"), RuntimeError("never ran")]

    def node(i: int) -> None:
        out = root / f"node-{i}"
        out.mkdir(mode=0o700, exist_ok=resume)
        settings = fleet_settings(data, out, holders=2, rounds=2, holder_inject=(inject or {}).get(i), fault=fault,
                                  resume=resume)
        try:
            results[i] = launch_gpus(settings, FleetOptions(gpus=2, timeout_s=120), quiet=True, rdzv=Rendezvous(
                nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id, sim_pki=pki, max_restarts=max_restarts))
        except GpuTravelError as exc:
            results[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


@pytest.fixture(scope="module")
def nodes(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any] | Exception]]:
    root = tmp_path_factory.mktemp("nodes")
    return root, _two_nodes(data, root)


@pytest.mark.slow
def test_two_nodes_sharing_no_folder_train_one_model(nodes: tuple[Path, list[dict[str, Any] | Exception]]) -> None:
    root, results = nodes
    reports = [r for r in results if isinstance(r, dict)]
    assert len(reports) == 2, results
    for report in reports:
        assert report["fleet"]["gpus"] == 2 and report["fleet"]["nodes"] == [0, 1]
        assert report["fleet"]["replica_digests_equal"] is True
        assert report["failed_visits"] == 0
    assert reports[0]["fleet"]["final_model_digest"] == reports[1]["fleet"]["final_model_digest"]
    # each node holds its own rank's folder only, and no fleet key anywhere
    for i in (0, 1):
        folder = RunFolder(root / f"node-{i}")
        assert len(folder.ranks()) == 1
        assert not any(p.name.endswith(".key") and "vendor" not in p.parts and "vendor-formats" not in p.parts
                       and "keys" not in p.parts for p in folder.path.rglob("*"))
    agreement = reports[0]["fleet"]["key_agreement"]
    assert agreement["verified"] == [0, 1] and agreement["workers"] == 2


@pytest.mark.slow
def test_rank_0s_node_keeps_the_fleet_ledger_with_every_ranks_head(
        nodes: tuple[Path, list[dict[str, Any] | Exception]]) -> None:
    root, results = nodes
    keeper = [i for i, r in enumerate(results) if isinstance(r, dict) and r["node"]["fleet_ledger"]]
    assert len(keeper) == 1
    ledger = RunFolder(root / f"node-{keeper[0]}").ledger
    assert verify_ledger(ledger).ok
    heads = {r.detail["gpu"]: r.detail["ledger_head"] for r in read_rows(ledger) if r.kind == "fleet-device"}
    assert sorted(heads) == [0, 1]
    other = RunFolder(root / f"node-{1 - keeper[0]}")
    (gpu, rank), = other.ranks()
    rank_result = verify_ledger(rank.ledger)
    assert heads[gpu] == f"{rank_result.rows}:{rank_result.head_hash}"  # the other node's head, sent over the group
    assert not other.ledger.exists()


@pytest.mark.slow
def test_a_node_whose_cvm_quote_is_wrong_is_refused_by_name(data: Path, tmp_path: Path) -> None:
    results = _two_nodes(data, tmp_path, inject={1: "cvm-debug"})
    assert all(isinstance(r, AttestationError) for r in results), results
    bad = json.loads(next(p for p in (tmp_path / "node-1").glob("rank-*/report.json")).read_text())
    rank = bad["gpu"]["rank"]
    for r in results:
        assert f"rank {rank}: td-not-debug" in str(r) and "no fleet key was sent" in str(r)
    for i in (0, 1):  # stopped before any device started or any visit: no rank ledger on either node
        assert not any(rank.ledger.exists() for _, rank in RunFolder(tmp_path / f"node-{i}").ranks())


@pytest.mark.slow
def test_ledger_verify_checks_the_whole_fleet_from_copies_of_each_nodes_folder(
        nodes: tuple[Path, list[dict[str, Any] | Exception]], tmp_path: Path) -> None:
    import sqlite3

    from typer.testing import CliRunner

    from gputravel.console.cli.main import app

    root, results = nodes
    copies = [tmp_path / f"copy-{i}" for i in (0, 1)]
    for i, copy in enumerate(copies):
        shutil.copytree(root / f"node-{i}", copy)
    keeper = next(i for i, r in enumerate(results) if isinstance(r, dict) and r["node"]["fleet_ledger"])
    fleet_ledger = str(RunFolder(copies[keeper]).ledger)
    every = ["--rank-ledgers", str(copies[0]), "--rank-ledgers", str(copies[1])]
    ok = CliRunner().invoke(app, ["ledger", "verify", fleet_ledger, *every, "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["ok"] is True
    only = CliRunner().invoke(app, ["ledger", "verify", fleet_ledger, "--rank-ledgers", str(copies[keeper])])
    assert only.exit_code == 8 and "whose ledgers were not given" in " ".join(only.output.split())
    (gpu, rank), = RunFolder(copies[1 - keeper]).ranks()
    with sqlite3.connect(rank.ledger) as db:  # the other node's rank ledger cut short
        db.execute("DELETE FROM events WHERE seq = (SELECT MAX(seq) FROM events)")
    cut = CliRunner().invoke(app, ["ledger", "verify", fleet_ledger, *every])
    assert cut.exit_code == 8 and f"(rank {gpu})" in " ".join(cut.output.split())


@pytest.mark.slow
def test_a_node_killed_mid_step_stops_the_other_by_name_and_both_resume_to_the_reference_digest(
        data: Path, nodes: tuple[Path, list[dict[str, Any] | Exception]], tmp_path: Path) -> None:
    """The worker that trains visit 2 (step 1) is SIGKILLed at TRAIN: its node's torchrun ends; the other
    node ends with a named error, no hang. Both nodes then --resume, each its own ranks (whatever ranks
    torchrun's rendezvous gives them this time), and reach the uninterrupted fleet's final digest."""
    _, reference = nodes
    killed = _two_nodes(data, tmp_path, fault="kill-orchestrator@TRAIN:2")
    assert all(isinstance(r, GpuTravelError) for r in killed), killed
    for r in killed:
        assert isinstance(r, GpuTravelError) and r.reason  # named, as torchrun or the rank's own word
    resumed = _two_nodes(data, tmp_path, resume=True)
    reports = [r for r in resumed if isinstance(r, dict)]
    assert len(reports) == 2, resumed
    want = {r["fleet"]["final_model_digest"] for r in reference if isinstance(r, dict)}
    assert len(want) == 1
    for report in reports:
        assert report["fleet"]["replica_digests_equal"] is True
        assert report["fleet"]["final_model_digest"] in want


@pytest.mark.slow
def test_max_restarts_across_nodes_restarts_the_killed_worker_and_reaches_the_reference_digest(
        data: Path, nodes: tuple[Path, list[dict[str, Any] | Exception]], tmp_path: Path) -> None:
    """The worker training step 1 is SIGKILLed at TRAIN with --max-restarts 1 on both nodes: its node's torchrun
    restarts it, the other node's torchrun restarts its own worker on the membership change (counting no
    restart there), both agree attempt 1 on the store, resume the last completed step and end in one job with
    the uninterrupted fleet's digest. (A one-node fleet's elastic restart is the same path; this test replaced
    its own.)"""
    _, reference = nodes
    results = _two_nodes(data, tmp_path, fault="kill-orchestrator@TRAIN:2", max_restarts=1)
    reports = [r for r in results if isinstance(r, dict)]
    assert len(reports) == 2, results
    want = {r["fleet"]["final_model_digest"] for r in reference if isinstance(r, dict)}
    for report in reports:
        assert report["fleet"]["replica_digests_equal"] is True
        assert report["fleet"]["final_model_digest"] in want
        assert report["fleet"]["key_agreement"]["attempt"] == 1
    merged = next(r for r in reports if r["node"]["fleet_ledger"])
    assert merged["ledger"]["verified"] is True and merged["failed_visits"] == 0
    # step 0 (visits 0, 1) was committed by the first attempt; the restarted one did step 1 (visits 2, 3)
    assert sorted(v["visit"] for v in merged["visits"] if v["outcome"] == "done") == [2, 3]
    for i in (0, 1):  # every rank's second life continued its first one's ledger
        (_, rank), = RunFolder(tmp_path / f"node-{i}").ranks()
        assert any(r.kind == "resumed" for r in read_rows(rank.ledger))
