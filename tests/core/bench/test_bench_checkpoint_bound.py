"""``bench checkpoint`` states its bound (issue 34 item 3): a plain write + fsync of as many bytes to the same file
system, measured in the same run; each round against the plain write just before it. Consistency only, no timing."""

from __future__ import annotations

import pytest

from gputravel.core.bench.checkpoint import study


@pytest.mark.process
def test_seal_and_write_is_reported_against_a_plain_write_and_fsync_of_the_same_run() -> None:
    r = study(model="tiny", chunk_size=64 << 10, rounds=2)
    assert r["bound"] == "plain write + fsync" and r["bound_mb_s"] == r["disk_write_mb_s"] > 0
    assert r["fraction_of_bound"] == pytest.approx(r["seal_mb_s"] / r["bound_mb_s"], rel=2e-3)
    assert [row["round"] for row in r["rows"]] == [1, 2]
    for row, seal, disk in zip(r["rows"], r["seal_mb_s_each"], r["disk_write_mb_s_each"], strict=True):
        assert row["seal_write_mb_s"] == seal and row["bound_mb_s"] == disk
        assert row["fraction_of_bound"] == pytest.approx(seal / disk, rel=2e-3, abs=1e-3)
    # the best round of each makes the headline: max of the plain writes, the fastest seal + write
    assert r["bound_mb_s"] == max(row["bound_mb_s"] for row in r["rows"])
