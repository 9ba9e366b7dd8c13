"""``gputravel bench travel``: a tiny study in-process; the fields of its rows; sizes that cannot run are skipped
with a reason. No timed assertions: only that times are measured (positive) and add up."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from gputravel.core.bench import travel as bt

FIELDS = ("buffer_mib", "path", "train_s", "tx_s", "tx_pct", "visits", "bytes", "mb_s", "steps", "status", "reason")


@pytest.mark.process
def test_tiny_study_rows_for_both_paths_and_a_skipped_size() -> None:
    from gputravel.console.cli import main as cli

    result = CliRunner().invoke(cli.app, ["bench", "travel", "--buffer-mib", "0.25,0.5,10000000", "--dataset-mib",
                                          "0.5", "--holders", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["benchmark"] == "travel"
    assert out["job"]["holder_mib"] == 0.5 and out["job"]["steps_per_mib"] > 0 and out["job"]["model"] == "tiny"
    assert {"cores", "mem_available_mib"} <= set(out["machine"])
    rows = out["rows"]
    for r in rows:
        assert set(FIELDS) <= set(r)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["buffer_mib"], r["path"]) for r in ok} == {(b, p) for b in (0.25, 0.5)
                                                           for p in ("travelling", "conventional")}
    for r in ok:
        assert r["train_s"] > 0 and r["tx_s"] > 0 and r["bytes"] > 0 and r["mb_s"] > 0
        assert r["tx_pct"] == pytest.approx(100 * r["tx_s"] / (r["tx_s"] + r["train_s"]), rel=1e-3)
    by = {(r["buffer_mib"], r["path"]): r for r in ok}
    for b in (0.25, 0.5):  # the same job on both paths: the same bytes, visits and steps
        t, c = by[(b, "travelling")], by[(b, "conventional")]
        assert (t["bytes"], t["visits"], t["steps"]) == (c["bytes"], c["visits"], c["steps"])
        assert t["data_path"] == "direct" and c["data_path"] == "conventional"
        assert str(b) in out["ratios"]
    assert by[(0.25, "travelling")]["visits"] > by[(0.5, "travelling")]["visits"]
    assert by[(0.25, "travelling")]["bytes"] == by[(0.5, "travelling")]["bytes"]  # one pass over the same data
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert {r["path"] for r in skipped} == {"travelling", "conventional"}
    for r in skipped:
        assert r["buffer_mib"] == 10000000 and r["reason"] and r["tx_s"] is None
        assert r["fraction_of_bound"] is None
    # issue 34: each row's bound is its bytes at the data-phase rate of bench provision's direct path, measured
    # in the same run; the visits' hand-off fixed cost by stage
    bound = out["bound"]
    assert bound["data_phase_mb_s"] > 0 and bound["size_mib"] > 0
    for r in ok:
        assert r["bound_tx_s"] == pytest.approx(r["bytes"] / (bound["data_phase_mb_s"] * 1e6), rel=1e-3, abs=2e-6)
        assert r["fraction_of_bound"] == pytest.approx(r["bound_tx_s"] / r["tx_s"], rel=1e-3, abs=1e-4)
        fixed = r["handoff_fixed_ms"]
        assert {"window", "attest", "verdict", "admission", "ring_bind", "first_chunk", "done", "total"} <= set(fixed)
        assert all(v >= 0 for v in fixed.values())
    assert out["job"]["attest_prefetch"] is True
    assert out["job"]["handoff_with_window"] is True  # the default since session 12


def test_skip_reasons() -> None:
    assert bt.skip_reason(4, max_mib=None, available=8 << 30) is None
    assert "--max-mib" in str(bt.skip_reason(100, max_mib=50, available=8 << 30))
    assert "memory" in str(bt.skip_reason(4096, max_mib=None, available=8 << 30))
    assert "limit" in str(bt.skip_reason(1e7, max_mib=None, available=1 << 60))
    assert bt.mem_available() > 0


def _report(visits: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    return {"visits": visits, "training": {"steps": steps, "model_params": 10}, "failed_visits": 0}


def test_row_and_ratio_arithmetic() -> None:
    def visit(tx: float, train: float) -> dict[str, Any]:
        return {"outcome": "done", "provision_s": tx, "train_s": train, "bytes": 1_000_000,
                "phase_s": {"ATTEST": 0.01, "PROVISION": tx, "TRAIN": train + 0.01, "ROTATE": 0.02}}

    base = {"buffer_mib": 4.0, "buffer_bytes": 4 << 20}
    t = bt.row_from_report(_report([visit(0.01, 1.0), visit(0.01, 1.0)], 8), {**base, "path": "travelling"}, 3.0)
    c = bt.row_from_report(_report([visit(0.05, 1.0), visit(0.05, 1.0)], 8), {**base, "path": "conventional"}, 3.0)
    assert t["tx_s"] == pytest.approx(0.02) and t["train_s"] == pytest.approx(2.0)
    assert t["tx_pct"] == pytest.approx(100 * 0.02 / 2.02, rel=1e-3) and t["mb_s"] == pytest.approx(100.0)
    assert t["protocol_s"] == pytest.approx(2 * 0.04, abs=1e-6) and t["status"] == "ok"
    r = bt.ratios([t, c])
    assert r["4.0"]["tx_conventional_over_travelling"] == pytest.approx(5.0)
    failed = bt.row_from_report({**_report([visit(0.01, 1.0), {**visit(0.01, 0.0), "outcome": "failed"}], 4),
                                  "failed_visits": 1}, {**base, "path": "travelling"}, 1.0)
    assert failed["status"] == "failed" and failed["visits"] == 1
    assert bt.label(None) == "uncapped" and bt.label(1e7) == "10000000" and bt.label(0.25) == "0.25"


def test_the_steady_state_leaves_out_each_holders_first_visit() -> None:
    """A holder's first visit opens its agent's data connection (nothing is parked to relay on): the row's
    ``handoff_fixed_ms_later`` is the median over the other visits, ``handoffs_relayable`` their count."""
    def visit(holder: str, admission: float, relayed: bool) -> dict[str, Any]:
        return {"outcome": "done", "holder": holder, "provision_s": 0.01, "train_s": 1.0, "bytes": 1_000_000,
                "phase_s": {}, "handoff_fixed_ms": {"admission": admission, "total": admission},
                "handoff_relayed": relayed}

    visits = [visit("a", 6.0, False), visit("b", 5.0, False), visit("a", 0.0, True), visit("b", 1.0, False)]
    row = bt.row_from_report(_report(visits, 4), {"buffer_mib": 20.0, "path": "travelling"}, 1.0)
    assert row["handoff_fixed_ms"]["admission"] == pytest.approx(3.0)  # the median of all four
    assert row["handoff_fixed_ms_later"] == {"admission": 0.5, "total": 0.5}
    assert (row["handoffs_relayed"], row["handoffs_relayable"]) == (1, 2)
    assert bt.row_from_report(_report(visits[:2], 2), {"path": "travelling"}, 1.0)["handoff_fixed_ms_later"] is None


@pytest.mark.parametrize("value", ["0", "x", "4,,20", "-1"])
def test_bad_buffer_sizes_are_usage_errors(value: str) -> None:
    from gputravel.console.cli import main as cli

    result = CliRunner().invoke(cli.app, ["bench", "travel", "--buffer-mib", value, "--json"])
    assert result.exit_code == 2, result.output


@pytest.mark.parametrize("value", ["", "travelling,travelling", "seed", "travelling,ssh"])
def test_bad_paths_are_usage_errors_naming_the_paths(value: str) -> None:
    from gputravel.console.cli import main as cli

    result = CliRunner().invoke(cli.app, ["bench", "travel", "--buffer-mib", "4", "--paths", value, "--json"])
    assert result.exit_code == 2 and "travelling, conventional" in result.output, result.output


@pytest.mark.process
def test_a_study_whose_runs_all_fail_exits_non_zero_with_the_reasons() -> None:
    from gputravel.console.cli import main as cli

    result = CliRunner().invoke(cli.app, ["bench", "travel", "--buffer-mib", "0.25", "--dataset-mib", "0.5",
                                          "--holders", "1", "--model", "no-such-model", "--transport", "local",
                                          "--json"])
    assert result.exit_code == 1, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("no-such-model" in r["reason"] for r in rows)


def _row(buffer_mib: float, path: str, stages: dict[str, float], *, later: bool = True) -> dict[str, Any]:
    fixed = {**stages, "total": sum(v for k, v in stages.items() if k != "data")}
    return {"buffer_mib": buffer_mib, "path": path, "status": "ok", "reason": None, "visits": 4, "steps": 8,
            "train_s": 1.0, "tx_s": 0.04, "tx_pct": 3.85, "tx_s_per_visit": 0.01, "mb_s": 400.0,
            "fraction_of_bound": 0.25, "handoff_fixed_ms": fixed,
            "handoff_fixed_ms_later": fixed if later else {"total": 0.0}}


def test_the_screen_draws_each_rows_fixed_cost_by_stage_on_one_scale() -> None:
    """The table's Tx per visit, fixed cost and fraction of bound, and a bar per row whose stage segments are
    proportional to the stages' ms on one scale for every row (a row with no later visits uses every visit)."""
    from rich.console import Console

    from gputravel.console.cli.commands.bench_travel import render

    rows = [_row(4.0, "travelling", {"window": 2.0, "done": 2.0, "data": 4.0}),
            _row(4.0, "conventional", {"window": 1.0, "first_chunk": 12.0, "done": 1.0, "data": 6.0}, later=False)]
    result = {"job": {"holders": 1, "holder_mib": 8.0, "model": "tiny", "batch_size": 8, "seq_len": 64,
                      "steps_per_mib": 4.0, "steps_rule": "a rule"}, "seconds": 3.0, "rows": rows,
              "ratios": {"4.0": {"tx_conventional_over_travelling": 2.5}}}
    console = Console(width=160, record=True, color_system=None)
    render(result, console)
    text = console.export_text()
    assert "Tx ms/visit" in text and "fixed ms" in text and "of bound" in text
    table_row = next(x for x in text.splitlines() if "travelling" in x and "│" in x)
    assert "10.00" in table_row and "4.00" in table_row and "0.25" in table_row  # Tx ms/visit, fixed ms, of bound
    bars = {path: next(x for x in text.splitlines() if f"4 MiB {path}" in x) for path in ("travelling", "conventional")}
    assert "fixed 4.00 + data 4.00 (later visits)" in bars["travelling"]
    assert "fixed 14.00 + data 6.00 (every visit)" in bars["conventional"]
    # one scale: 60 cells for the longest row (20 ms), so the travelling row's 8 ms draw 24 cells
    assert bars["conventional"].count("█") == 60 and bars["travelling"].count("█") == 24
    legend = next(x for x in text.splitlines() if "█ window" in x)
    assert all(f"█ {stage}" in legend for stage in ("attest", "verdict", "admission", "ring_bind", "first_chunk",
                                                    "done", "data"))
