"""scripts/handoff_hops.py (issue 34 item 2, task fixed13): a marks log read into a relayed hand-off's hops, in order,
per visit; a visit whose HANDOFF was not relayed is counted, not tabled; a line that is not a mark is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

# one relayed visit (µs after 1 s), then a holder's first (no relay: no a_rd_HANDOFF), then marks of no visit
VISIT = [("o_open", 0), ("o_req_written", 500), ("d_req_read", 900), ("d_op_begin", 1000), ("a_rd_HANDOFF", 1600),
         ("d_ans_written", 1700), ("a_main_handoff", 1800), ("o_readable", 2000), ("o_grant", 2300),
         ("a_first_sent", 3000), ("d_first_chunk", 3500), ("d_last_chunk", 9000), ("d_acks_sent", 9100),
         ("a_rd_ACK", 9900), ("a_last_ack", 11000), ("a_done_written", 11100), ("s_pipe_rx", 11200),
         ("o_ssh_rx", 13000), ("o_ssh_rx", 13500), ("o_done_read", 14000)]
FIRST = [("o_open", 20000), ("o_req_written", 20500), ("d_req_read", 20900), ("d_op_begin", 21000),
         ("o_done_read", 30000)]


def _log(tmp_path: Path, marks: list[tuple[str, int]]) -> Path:
    path = tmp_path / "hops.log"
    # written out of order, from several processes: the script sorts by time
    lines = [f"{name} {1_000_000_000 + us * 1000} {100 + i % 3} Thread-{i}" for i, (name, us) in enumerate(marks)]
    path.write_text("\n".join(reversed(lines)) + "\n")
    return path


def test_a_relayed_visit_is_split_into_its_hops_in_order(tmp_path: Path) -> None:
    mod = load_script("handoff_hops")
    got = mod.main([str(_log(tmp_path, VISIT + FIRST + [("d_req_read", 40000)]))])
    assert got["visits"] == 2 and got["relayed"] == 1
    hops = {h["hop"]: h["median_us"] for h in got["hops"]}
    assert hops["o_open>o_req_written"] == 500.0
    assert hops["d_op_begin>a_rd_HANDOFF"] == 600.0
    assert hops["a_rd_ACK>a_last_ack"] == 1100.0
    assert hops["s_pipe_rx>o_ssh_rx"] == 1800.0  # the first o_ssh_rx after the pipe's read
    assert hops["o_ssh_rx>o_done_read"] == 1000.0
    assert hops["window_us"] == 3500.0 and hops["done_us"] == 5000.0
    window = sum(h["median_us"] for h in got["hops"] if h["stage"] == "window" and h["hop"] != "window_us")
    done = sum(h["median_us"] for h in got["hops"] if h["stage"] == "done" and h["hop"] != "done_us")
    assert window == hops["window_us"] and done == hops["done_us"]  # the hops tile each stage


def test_a_line_that_is_not_a_mark_is_named(tmp_path: Path) -> None:
    path = tmp_path / "hops.log"
    path.write_text("o_open 12 1 MainThread\nnot a mark\n")
    with pytest.raises(ValueError, match="hops.log:2"):
        load_script("handoff_hops").main([str(path)])
