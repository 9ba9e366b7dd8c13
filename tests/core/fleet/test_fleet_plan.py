"""The planner's fleet extension (pure): packing visits into lock-step steps, the all-reduce fit, the
prediction; and the fleet study's row from a report."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gputravel.core import fleetplan, planner
from gputravel.core.bench.fleet import _efficiency, _sealed_vs_plain, row_from_report
from gputravel.core.errors import ConfigError
from tests.core.test_planner import RUNS, synthetic_travel

E0, E1 = 0.001, 0.02  # all-reduce: s per optimizer step, s per ring-weighted step


def synthetic_fleet(rows: list[tuple[int, int]], *, k: int = 4) -> dict[str, Any]:
    """A 'bench fleet --json' document: (gpus, lock-step steps) whose all-reduce follows the model exactly."""
    out = []
    for gpus, steps in rows:
        opt = steps * k
        per_gpu = E0 * opt + E1 * opt * 2 * (gpus - 1) / gpus
        out.append({"gpus": gpus, "variant": "secure_pipelined", "status": "ok", "steps": steps,
                    "allreduce_s": per_gpu * gpus})
    out.append({"gpus": 8, "variant": "secure_pipelined", "status": "failed", "reason": "no"})
    return {"benchmark": "fleet", "job": {"steps_per_visit": k}, "rows": out}


def test_visits_pack_into_steps_without_sharing_a_holder() -> None:
    visits = planner.schedule([3 * planner.MIB, 1 * planner.MIB, 1 * planner.MIB], buffer_bytes=planner.MIB)
    steps = fleetplan.fleet_steps(visits, gpus=2)
    assert sum(len(s) for s in steps) == len(visits)
    for step in steps:
        assert len({v.holder for v in step}) == len(step) <= 2
    with pytest.raises(ConfigError):
        fleetplan.fleet_steps(visits, gpus=0)


def test_allreduce_fit_recovers_the_ring_cost() -> None:
    doc = synthetic_fleet([(1, 4), (2, 2), (4, 1), (2, 4), (4, 2)])
    samples = fleetplan.fleet_samples_from_report(doc)
    assert len(samples) == 5  # the failed row is left out
    term = fleetplan.fit_allreduce(samples, variant="secure_pipelined")
    assert term.coef == pytest.approx([E0, E1], rel=1e-6)
    assert planner.samples_from_report(doc) == []  # a fleet document holds no travel runs
    with pytest.raises(ConfigError):
        fleetplan.fit_allreduce(samples, variant="plain")


def test_fleet_prediction_splits_the_work_and_adds_the_all_reduce() -> None:
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS)))
    term = fleetplan.fit_allreduce(fleetplan.fleet_samples_from_report(synthetic_fleet([(1, 4), (2, 2), (4, 1)])),
                                 variant="secure_pipelined")
    sizes = [2 * planner.MIB] * 4
    one = fleetplan.predict_fleet(model, term, sizes, gpus=1, buffer_bytes=4 * planner.MIB, steps_per_visit=10)
    two = fleetplan.predict_fleet(model, term, sizes, gpus=2, buffer_bytes=4 * planner.MIB, steps_per_visit=10)
    assert (one["steps"], two["steps"]) == (4, 2)
    assert two["train_s"] == pytest.approx(one["train_s"] / 2)
    assert two["allreduce_s"] > one["allreduce_s"]  # the ring costs what one GPU never pays
    assert two["total_s"] == pytest.approx(two["tx_s"] + two["train_s"] + two["allreduce_s"])
    three = fleetplan.predict_fleet(model, term, [planner.MIB] * 3, gpus=2, buffer_bytes=4 * planner.MIB,
                                  steps_per_visit=10)
    assert three["idle_slots"] == 1  # H = 3 on N = 2


def _report(gpus: int, tokens: int, train_s: float, ar_s: float) -> dict[str, Any]:
    devices = [{"allreduce_s": ar_s, "train_s": train_s}] * gpus
    return {"seconds": 10.0, "fleet": {"devices": devices, "steps": 2, "tokens": tokens, "train_s": train_s,
                                       "tokens_per_s": tokens / train_s,
                                       "allreduce": {"calls": 8, "seconds": ar_s * gpus, "sealed": True},
                                       "replica_digests_equal": True}}


def test_study_rows_give_efficiency_and_the_sealed_over_plain_ratio() -> None:
    rows = [row_from_report(_report(1, 1000, 1.0, 0.0), gpus=1, variant="secure_pipelined"),
            row_from_report(_report(2, 1000, 0.8, 0.4), gpus=2, variant="secure_pipelined"),
            row_from_report(_report(1, 1000, 1.0, 0.0), gpus=1, variant="plain"),
            row_from_report(_report(2, 1000, 0.5, 0.1), gpus=2, variant="plain")]
    assert rows[1]["allreduce_share"] == pytest.approx(0.5)
    _efficiency(rows)
    assert rows[1]["efficiency"] == pytest.approx(1250 / 2000)  # against the fastest one-GPU row
    assert rows[3]["efficiency"] == pytest.approx(1.0)
    ratio = _sealed_vs_plain(rows)
    assert ratio == [{"gpus": 2, "variant": "secure_pipelined", "allreduce_s_over_plain": 4.0,
                      "tokens_per_s_plain_over_sealed": 1.6, "allreduce_share": 0.5,
                      "allreduce_share_plain": 0.2}]


def test_plan_cli_predicts_a_fleet_from_travel_and_fleet_runs(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from gputravel.console.cli import main as cli

    travel = tmp_path / "travel.json"
    travel.write_text(json.dumps(synthetic_travel(RUNS)))
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(synthetic_fleet([(1, 4), (2, 2), (4, 1)])))
    result = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "1G,1G,1G", "--buffer-mib", "256", "--gpus",
                                          "2", "--from", str(travel), "--from", str(fleet), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    pred = doc["fleet"]["prediction"]
    assert pred["gpus"] == 2 and pred["idle_slots"] > 0  # 3 holders' visits on 2 GPUs
    assert pred["total_s"] < doc["fleet"]["one_gpu"]["total_s"]
    missing = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "1G", "--gpus", "2", "--from", str(travel)])
    assert missing.exit_code != 0 and "bench fleet" in missing.output


def test_study_keeps_the_median_of_its_repeats(tmp_path: Any) -> None:
    from gputravel.core.bench.fleet import study

    speeds = iter([1000.0, 3000.0, 2000.0] * 4)
    calls: list[tuple[int, str]] = []

    def launch(settings: Any, fleet: Any) -> dict[str, Any]:
        calls.append((fleet.gpus, fleet.variant))
        return _report(fleet.gpus, int(next(speeds)), 1.0, 0.1 if fleet.gpus > 1 else 0.0)

    result = study([1, 2], workdir=tmp_path, variants=("secure_pipelined",), holders=2, holder_kib=16,
                   repeats=3, launch=launch)
    assert len(calls) == 6 and result["benchmark"] == "fleet"
    rows = {r["gpus"]: r for r in result["rows"]}
    assert rows[1]["repeats"] == 3 and rows[1]["tokens_per_s"] == 2000.0  # the median of 1000, 2000, 3000
    assert fleetplan.fleet_samples_from_report(result)  # the planner reads the study's own output


def test_study_over_nodes_runs_each_node_in_its_own_folder_and_gives_the_ratio_to_one_node(tmp_path: Any) -> None:
    """``nnodes=(2,)``: the same GPUs once on one node, once as two nodes (a launch each, its own ``--out``, one
    rendezvous, the SIM PKI exported once); rank 0's node's report is the row, the ratio is in the JSON."""
    from gputravel.core.bench.fleet import study

    calls: list[tuple[int, Path, Any]] = []
    lock = threading.Lock()

    def launch(settings: Any, fleet: Any, rdzv: Any = None) -> dict[str, Any]:
        with lock:
            calls.append((fleet.gpus, settings.out_dir, rdzv))
        if rdzv is None:
            return _report(fleet.gpus, 2000, 1.0, 0.1)
        if settings.out_dir.name != "node-0":
            return {"merged_elsewhere": True, "ranks": [1]}
        return _report(fleet.gpus, 1900, 1.0, 0.1)

    result = study([1, 2], workdir=tmp_path, variants=("secure_pipelined",), holders=2, holder_kib=16,
                   nnodes=(2,), launch=launch)
    node_calls = [c for c in calls if c[2] is not None]
    assert len(calls) == 4 and len(node_calls) == 2  # 1 GPU on one node; 2 GPUs on one node and on two
    assert {c[1].name for c in node_calls} == {"node-0", "node-1"} and node_calls[0][1] != node_calls[1][1]
    assert {c[2].nnodes for c in node_calls} == {2} and node_calls[0][2] is node_calls[1][2]
    assert node_calls[0][2].sim_pki.exists() and node_calls[0][2].rdzv_endpoint.startswith("127.0.0.1:")
    assert [(r["gpus"], r["nnodes"]) for r in result["rows"]] == [(1, 1), (2, 1), (2, 2)]
    assert result["nodes_vs_one"] == [{"gpus": 2, "variant": "secure_pipelined", "nnodes": 2, "tokens_per_s": 1900.0,
                                       "tokens_per_s_one_node": 2000.0, "tokens_per_s_ratio": 0.95}]
