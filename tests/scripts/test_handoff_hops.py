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


# task admission15: the relayed HANDOFF to the first chunk, marks with each thread's and process's CPU (µs after 1 s);
# (name, µs, pid, thread, thread cpu µs, process cpu µs)
ADMISSION = [("o_open", 0, 1, 1, 0, 0), ("d_op_begin", 100, 2, 1, 0, 0), ("d_relayed", 300, 2, 1, 150, 150),
             ("a_rd_HANDOFF", 1300, 3, 2, 10, 10), ("a_main_handoff", 1500, 3, 1, 500, 700),
             ("a_parsed", 1700, 3, 1, 700, 900), ("a_taken", 1750, 3, 1, 750, 950),
             ("a_accepted", 1900, 3, 1, 880, 1080), ("a_witness", 2200, 3, 1, 1180, 1380),
             ("a_checked", 2250, 3, 1, 1230, 1430), ("a_admit_made", 2450, 3, 1, 1400, 1650),
             ("a_admit_sent", 2600, 3, 1, 1500, 1750), ("d_dataopen_read", 3000, 2, 3, 0, 400),
             ("d_admit_read", 3200, 2, 3, 200, 600), ("d_admitted", 3500, 2, 3, 500, 900),
             ("d_ring_bound", 3600, 2, 3, 600, 1000), ("a_first_sealed", 4200, 3, 1, 2100, 2350),
             ("a_first_sent", 4300, 3, 1, 2200, 2450), ("d_chunk_read", 5300, 2, 3, 700, 1100),
             ("d_first_chunk", 5900, 2, 4, 0, 1800), ("o_done_read", 9000, 1, 1, 0, 0),
             ("o_open", 20000, 1, 1, 0, 0), ("d_op_begin", 20100, 2, 1, 0, 0), ("o_done_read", 30000, 1, 1, 0, 0)]


def test_the_admission_set_tiles_admission_to_the_first_chunk_with_cpu(tmp_path: Path) -> None:
    path = tmp_path / "hops.log"
    path.write_text("".join(f"{n} {1_000_000_000 + us * 1000} {pid} T{th} {c * 1000} {p * 1000}\n"
                            for n, us, pid, th, c, p in reversed(ADMISSION)))
    got = load_script("handoff_hops").main([str(path), "--set", "admission"])
    assert got["visits"] == 2 and got["relayed"] == 1  # the holder's first (no relay) is counted, not tabled
    hops = {h["hop"]: h for h in got["hops"]}
    assert hops["a_accepted>a_witness"]["median_us"] == 300.0 and hops["a_accepted>a_witness"]["cpu_us"] == 300.0
    assert hops["a_rd_HANDOFF>a_main_handoff"]["cpu_us"] is None  # two threads: no one thread's CPU
    assert hops["a_rd_HANDOFF>a_main_handoff"]["others_cpu_us"] == 690.0  # the process's CPU less the reader's 10
    assert hops["a_admit_made>d_dataopen_read"]["others_cpu_us"] is None  # two processes
    assert hops["a_main_handoff>a_admit_sent"]["median_us"] == 1100.0
    tiled = sum(h["median_us"] for h in got["hops"] if h["stage"] != "agent")
    assert tiled == 5800.0  # d_op_begin to d_first_chunk: the stages' hops tile it
