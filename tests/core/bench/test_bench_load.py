"""``bench load`` by holder count (issue 34 item 4): a row per count with the orchestrator's per-visit time, its
memory and its descriptors; nothing in the orchestrator grows with the square of the holders.

No timing assertions: the rows' fields, their consistency, every visit done, and a descriptor count bounded by a
line in the holders (a quadratic one, a connection per pair of holders, would be thousands at 128)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import ENTRIES

from gputravel.core.bench.load import growth, load
from gputravel.core.bench.procmem import open_fds
from gputravel.core.errors import ConfigError

ROW = {"holders", "orchestrator_ms_per_visit", "rss_mb", "open_fds"}


def no_ssh_server(holders: list[tuple[str, Path]], workdir: Path | None, /, *, data_route: str = "forward") -> Any:
    raise AssertionError("the local transport starts no SSH server")


def run_load(tmp_path: Path, holders: int) -> dict[str, Any]:
    return asyncio.run(load(holders=holders, rounds=1, holder_kib=1, steps_per_visit=1, workdir=tmp_path / str(holders),
                            server=no_ssh_server, entries=ENTRIES, transport="local"))


def test_growth_compares_the_fewest_holders_with_the_most() -> None:
    rows = [{"holders": 8, "orchestrator_ms_per_visit": 10.0, "rss_mb": 300.0, "open_fds": 40},
            {"holders": 128, "orchestrator_ms_per_visit": 11.0, "rss_mb": 420.0, "open_fds": 520}]
    g = growth(rows)
    assert (g["from_holders"], g["to_holders"]) == (8, 128)
    assert g["orchestrator_ms_per_visit_ratio"] == pytest.approx(1.1)
    assert g["rss_mb_per_added_holder"] == pytest.approx(1.0) and g["open_fds_per_added_holder"] == pytest.approx(4.0)
    assert growth(rows[:1]) == {}


def test_open_fds_counts_this_process_descriptors() -> None:
    before = open_fds()
    with open(__file__) as _f:
        assert open_fds() == before + 1


def test_an_unknown_transport_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="transport"):
        asyncio.run(load(holders=1, rounds=1, holder_kib=1, steps_per_visit=1, workdir=tmp_path,
                         server=no_ssh_server, entries=ENTRIES, transport="carrier-pigeon"))


@pytest.mark.slow
@pytest.mark.process
def test_128_local_holders_each_visited_with_descriptors_linear_in_the_holders(tmp_path: Path) -> None:
    small, big = run_load(tmp_path, 8), run_load(tmp_path, 128)
    for result, n in ((small, 8), (big, 128)):
        assert result["outcomes"] == {"done": n, "failed": 0}
        assert result["ledger"]["verified"] is True
        (row,) = result["rows"]
        assert ROW <= set(row) and row["holders"] == n and row["visits"] == n
        assert row["orchestrator_ms_per_visit"] > 0 and row["rss_mb"] > 0 and row["open_fds"] > row["open_fds_before"]
    per_holder = (big["rows"][0]["open_fds"] - small["rows"][0]["open_fds"]) / (128 - 8)
    # a local agent costs the orchestrator its three pipes and their transports: a small constant per holder,
    # never one per pair of holders (128² = 16,384)
    assert per_holder <= 8, big["rows"][0]
    assert big["rows"][0]["open_fds"] <= 8 * 128 + small["rows"][0]["open_fds"]
