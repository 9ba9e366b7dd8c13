"""scripts/window_call_ab.py (issue 34 item 2): the window's key asked from the loop and through a worker thread, in
turn, against one real device process; every round of both is timed, and the device is left shut down."""

from __future__ import annotations

from helpers import load_script


def test_both_calls_are_timed_in_turn() -> None:
    got = load_script("window_call_ab").main(["--rounds", "6"])
    assert got["rounds"] == 6
    for variant in ("to_thread", "on_loop"):
        rec = got[variant]
        assert 0 < rec["p10_us"] <= rec["median_us"] <= rec["p90_us"]
    assert 0.0 <= got["on_loop_faster_share"] <= 1.0
