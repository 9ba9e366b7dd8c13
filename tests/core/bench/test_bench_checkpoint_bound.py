"""``bench checkpoint`` states its bound (issue 34 item 3): a plain write + fsync of the same bytes to the same folder,
measured in the same run two ways (write then fsync; writeback as it goes, as the checkpoint writer does), the faster
one the bound; each round against the faster of its own two. Consistency only, no timing."""

from __future__ import annotations

import pytest

from gputravel.core.bench.checkpoint import study


@pytest.mark.process
def test_seal_and_write_is_reported_against_a_plain_write_and_fsync_of_the_same_run() -> None:
    r = study(model="tiny", chunk_size=64 << 10, rounds=2)
    best_plain, best_wb = r["disk_write_mb_s"], r["disk_write_writeback_mb_s"]
    assert r["bound"] == "plain write + fsync" and r["bound_mb_s"] == max(best_plain, best_wb) > 0
    assert r["bound_write"] == ("writeback" if best_wb >= best_plain else "write then fsync")
    assert r["fraction_of_bound"] == pytest.approx(r["seal_mb_s"] / r["bound_mb_s"], rel=2e-3, abs=1e-3)  # 3 places
    assert r["snapshot_s"] > 0  # the run's path: the device copies its state, then seals the copy (not counted)
    assert [row["round"] for row in r["rows"]] == [1, 2]
    for row, seal, disk, wb in zip(r["rows"], r["seal_mb_s_each"], r["disk_write_mb_s_each"],
                                   r["disk_write_writeback_mb_s_each"], strict=True):
        assert (row["seal_write_mb_s"], row["plain_write_mb_s"], row["writeback_write_mb_s"]) == (seal, disk, wb)
        assert row["bound_mb_s"] == max(disk, wb)
        assert row["fraction_of_bound"] == pytest.approx(seal / max(disk, wb), rel=2e-3, abs=1e-3)
    # the best round of each makes the headline: the fastest plain writes, the fastest seal + write
    assert best_plain == max(r["disk_write_mb_s_each"]) and best_wb == max(r["disk_write_writeback_mb_s_each"])
    assert r["seal_mb_s"] == max(r["seal_mb_s_each"])
