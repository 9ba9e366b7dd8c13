"""The transfer planner (core/planner.py) and ``gputravel plan``: sizes, the schedule's shape, the fit, held-out
error, prediction. No timing: every number here is synthetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from gputravel.core import planner, sizes
from gputravel.core.errors import ConfigError

GIB, MIB = 1 << 30, 1 << 20


# --- sizes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("10G", 10 * GIB), ("512M", 512 * MIB), ("1.5T", int(1.5 * (1 << 40))), ("64K", 64 << 10), ("100", 100),
    ("2GiB", 2 * GIB), ("1GB", 10**9), ("3 mb", 3 * 10**6), (" 7g ", 7 * GIB), ("1e3", 1000), ("0.5K", 512),
])
def test_parse_size(text: str, expected: int) -> None:
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "abc", "10X", "-1G", "0", "0.1", "1..5G", "10 G B", "nanG", "inf"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        sizes.parse_size(text)


def test_parse_sizes_list() -> None:
    assert sizes.parse_sizes("10G,512M,1.5T") == [10 * GIB, 512 * MIB, int(1.5 * (1 << 40))]
    for bad in ("10G,,5G", ",", "10G,zz"):
        with pytest.raises(ConfigError):
            sizes.parse_sizes(bad)


def test_parse_buffer_list() -> None:
    assert sizes.parse_buffer_list("4,20,100,500,uncapped") == [4.0, 20.0, 100.0, 500.0, None]
    assert sizes.parse_buffer_list("0.25, 0.5") == [0.25, 0.5]
    for bad in ("0", "-4", "x", "4,,20", "nan"):
        with pytest.raises(ConfigError):
            sizes.parse_buffer_list(bad)


# --- the schedule's shape ------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, buffer", [([10 * MIB, 3 * MIB + 7], 1 * MIB), ([5000, 123457], 4096),
                                           ([8 * MIB], 64 * MIB)])
def test_schedule_matches_the_engine(sizes: list[int], buffer: int) -> None:
    from gputravel.core.travel.holders import HolderInfo
    from gputravel.core.travel.schedule import plan_visits

    infos = []
    for i, size in enumerate(sizes):
        train, val = planner.split_holder(size)
        infos.append(HolderInfo(f"h{i}", "byte", train, val, 1, "", "local"))
    engine = plan_visits(infos, rounds=1, buffer_bytes=buffer, val_share=0.1, min_train_bytes=1)
    ours = planner.schedule(sizes, buffer_bytes=buffer)
    assert sorted((p.window_len, p.train_len) for p in engine) == sorted((v.window_bytes, v.train_bytes)
                                                                          for v in ours)


def test_uncapped_buffer_takes_a_holder_in_one_visit() -> None:
    sizes = [3 * MIB, 5 * MIB + 3]
    buf = planner.uncapped_buffer_bytes(sizes)
    visits = planner.schedule(sizes, buffer_bytes=buf)
    assert len(visits) == 2 and buf % 4096 == 0


def test_steps_are_proportional_to_the_data() -> None:
    assert planner.steps_for(10 * MIB, 4) == 40
    assert planner.steps_for(1, 4) == 1
    # one round: the total steps depend on the buffer size only through rounding each visit's steps
    totals = [sum(planner.steps_for(v.train_bytes, 4) for v in planner.schedule([40 * MIB] * 2, buffer_bytes=b * MIB))
              for b in (4, 20, 50)]
    assert max(totals) - min(totals) <= 0.05 * max(totals)


# --- the fit -------------------------------------------------------------------------------------------
A, B, C, D = 0.02, 1 / 500e6, 0.05, 0.03  # s/visit, s/byte, s/visit, s/step


def synthetic_travel(runs: list[tuple[int, int, int]], *, noise: float = 0.0, seed: int = 0,
                     conv_factor: float = 5.0) -> dict[str, Any]:
    """A 'bench travel --json' document whose runs follow the model exactly (or with relative noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for visits, nbytes, steps in runs:
        for path, f in (("travelling", 1.0), ("conventional", conv_factor)):
            e = 1 + noise * rng.standard_normal(2) if noise else np.ones(2)
            rows.append({"buffer_mib": nbytes / visits / MIB, "path": path, "status": "ok", "visits": visits,
                         "bytes": nbytes, "steps": steps, "tx_s": f * (A * visits + B * nbytes) * e[0],
                         "train_s": (C * visits + D * steps) * e[1]})
    rows.append({"buffer_mib": 1e7, "path": "travelling", "status": "skipped", "reason": "too big"})
    return {"benchmark": "travel", "job": {"model": "tiny", "steps_per_mib": 4.0, "batch_size": 8, "seq_len": 64},
            "rows": rows}


RUNS = [(20, 80 * MIB, 320), (4, 80 * MIB, 320), (2, 80 * MIB, 320), (10, 20 * MIB, 80), (3, 200 * MIB, 800)]


def test_fit_recovers_synthetic_coefficients_exactly() -> None:
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS)))
    assert model.transfer["travelling"].coef == pytest.approx([A, B], rel=1e-9)
    assert model.transfer["conventional"].coef == pytest.approx([5 * A, 5 * B], rel=1e-9)
    assert model.train is not None and model.train.coef == pytest.approx([C, D], rel=1e-9)
    assert model.steps_per_mib == 4.0
    for term in (*model.transfer.values(), model.train):
        assert term.fit_error["mape"] == pytest.approx(0, abs=1e-9)
        assert len(term.loo) == term.n  # every run held out once
        assert term.loo_error["mape"] == pytest.approx(0, abs=1e-9)
        assert term.loo_error["max_ape"] == pytest.approx(0, abs=1e-9)
    assert model.train.n == 2 * len(RUNS)  # training is fitted on both paths' runs


def test_leave_one_out_error_is_reported_on_noisy_runs() -> None:
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS, noise=0.05, seed=3)))
    term = model.transfer["travelling"]
    assert term.loo_error["mape"] is not None and 0 < term.loo_error["mape"] < 0.5
    assert term.loo_error["max_ape"] >= term.loo_error["mape"]
    held = {e["held_out"] for e in term.loo}
    assert len(held) == len(RUNS)
    for e in term.loo:
        assert e["error"] == pytest.approx((e["predicted_s"] - e["measured_s"]) / e["measured_s"])
    json.dumps(model.to_dict())  # JSON-able (no numpy scalars)


def test_fit_is_nonnegative_and_falls_back_when_underdetermined() -> None:
    x = np.array([[1.0, 10.0], [2.0, 10.0], [4.0, 10.0]])
    y = np.array([5.0, 4.0, 3.0])  # falls with visits: an unconstrained fit goes negative
    coef = planner.fit_nonnegative(x, y)
    assert np.all(coef >= 0)
    one = planner.fit_term("t", ("visits", "bytes"), np.array([[3.0, 3e6]]), np.array([0.3]), ["only"])
    assert "proportional" in one.note and one.loo_error["mape"] is None
    assert one.predict([3.0, 3e6]) == pytest.approx(0.3)


def test_predict_sums_the_visits() -> None:
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS)))
    sizes = [10 * GIB, 20 * GIB, 5 * GIB]
    out = planner.predict(model, sizes, buffer_bytes=256 * MIB)
    visits = planner.schedule(sizes, buffer_bytes=256 * MIB)
    steps = [planner.steps_for(v.train_bytes, 4.0) for v in visits]
    tx = sum(A + B * v.window_bytes for v in visits)
    train = sum(C + D * s for s in steps)
    trav = out["paths"]["travelling"]
    assert out["visits"] == len(visits) and out["steps"] == sum(steps)
    assert trav["run"]["tx_s"] == pytest.approx(tx) and trav["run"]["train_s"] == pytest.approx(train)
    assert trav["run"]["tx_pct"] == pytest.approx(100 * tx / (tx + train))
    assert out["conventional_over_travelling_tx"] == pytest.approx(5.0)
    full = trav["visit"]
    assert full["bytes"] == max(v.window_bytes for v in visits)
    assert full["tx_s"] == pytest.approx(A + B * full["bytes"])
    twice = planner.predict(model, sizes, buffer_bytes=256 * MIB, rounds=2)
    assert twice["paths"]["travelling"]["run"]["tx_s"] == pytest.approx(2 * tx)


def test_gbps_overrides_the_measured_rate() -> None:
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS)))
    wire = 8 / 1e9  # 1 Gb/s: slower than the measured 500 MB/s
    a, b = planner.transfer_coef(model, "travelling", gbps=1.0)
    assert (a, b) == pytest.approx((A, max(B, wire)))  # overlapped with decryption
    a, b = planner.transfer_coef(model, "conventional", gbps=1.0)
    assert (a, b) == pytest.approx((5 * A, 5 * B + wire))  # store and forward
    fast = planner.transfer_coef(model, "travelling", gbps=400.0)
    assert fast[1] == pytest.approx(B)  # a fast link leaves the measured pipeline the bottleneck
    with pytest.raises(ConfigError):
        planner.transfer_coef(model, "travelling", gbps=0.0)


def test_provision_rows_feed_the_transfer_fit() -> None:
    doc = {"benchmark": "provision", "rows": [
        {"path": "direct", "size_mib": s, "median_s": A + B * s * MIB} for s in (8, 64, 256)] + [
        {"path": "ssh", "size_mib": 64, "median_s": 1.0},  # not one of the two compared paths
        {"path": "direct", "size_mib": 64, "median_s": 9.0, "overlap": False}]}  # an ablation row
    samples = planner.samples_from_report(doc, source="p.json:")
    assert [s.path for s in samples] == ["travelling"] * 3 and all(s.visits == 1 for s in samples)
    model = planner.fit_model(samples)
    assert model.transfer["travelling"].coef == pytest.approx([A, B], rel=1e-9)
    assert model.train is None
    with pytest.raises(ConfigError, match="training"):
        planner.predict(model, [GIB], buffer_bytes=64 * MIB, steps_per_mib=4)


def test_bad_inputs_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        planner.samples_from_report({"benchmark": "load"})
    with pytest.raises(ConfigError):
        planner.fit_model([])
    model = planner.fit_model(planner.samples_from_report(synthetic_travel(RUNS)))
    with pytest.raises(ConfigError):
        planner.predict(model, [GIB], buffer_bytes=64 * MIB, rounds=0)
    with pytest.raises(ConfigError):
        planner.schedule([0], buffer_bytes=MIB)


# --- the command ---------------------------------------------------------------------------------------
def test_plan_command_from_files(tmp_path: Path) -> None:
    from gputravel.console.cli import main as cli

    f = tmp_path / "travel.json"
    f.write_text(json.dumps(synthetic_travel(RUNS, noise=0.02, seed=1)))
    result = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "10G,20G,5G", "--buffer-mib", "256",
                                          "--from", str(f), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["holder_bytes"] == [10 * GIB, 20 * GIB, 5 * GIB]
    for path in planner.PATHS:
        p = out["prediction"]["paths"][path]
        assert p["run"]["tx_s"] > 0 and p["run"]["train_s"] > 0 and 0 < p["run"]["tx_pct"] < 100
        assert p["visit"]["tx_s"] > 0
    assert out["model"]["transfer"]["travelling"]["loo_error"]["mape"] is not None
    assert out["prediction"]["conventional_over_travelling_tx"] == pytest.approx(5.0, rel=0.1)
    with_link = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "10G", "--from", str(f), "--gbps", "1",
                                             "--json"])
    assert with_link.exit_code == 0, with_link.output
    assert json.loads(with_link.stdout)["prediction"]["gbps"] == 1.0
    table = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "10G,5G", "--from", str(f)])
    assert table.exit_code == 0 and "travelling" in table.stdout and "held-out" in table.stdout


@pytest.mark.parametrize("args", [["--holder-bytes", "10X"], ["--holder-bytes", "10G,,1G"],
                                  ["--holder-bytes", "10G", "--gbps", "-1"],
                                  ["--holder-bytes", "10G", "--buffer-mib", "0"]])
def test_plan_command_rejects_bad_input(tmp_path: Path, args: list[str]) -> None:
    from gputravel.console.cli import main as cli

    f = tmp_path / "travel.json"
    f.write_text(json.dumps(synthetic_travel(RUNS)))
    result = CliRunner().invoke(cli.app, ["plan", *args, "--from", str(f)])
    assert result.exit_code == 2, result.output  # a usage error (BadParameter), not a traceback
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_plan_command_rejects_a_file_that_is_not_a_benchmark(tmp_path: Path) -> None:
    from gputravel.console.cli import main as cli

    f = tmp_path / "other.json"
    f.write_text(json.dumps({"benchmark": "soak"}))
    result = CliRunner().invoke(cli.app, ["plan", "--holder-bytes", "1G", "--from", str(f)])
    assert result.exit_code == 2 and "bench travel" in result.output
