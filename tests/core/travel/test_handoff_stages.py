"""The hand-off's fixed cost by stage (issue 34 item 2): ``handoff.fixed_stages`` puts the link's moments and the
device's (in ns after its window opened) on one clock and cuts the hand-off into its stages."""

from __future__ import annotations

import pytest

from gputravel.core.protocol.deviceanswers import WindowClosed
from gputravel.core.travel import handoff as ho
from gputravel.core.travel.holders import ProvisionStats

MS = 1_000_000


def closed(**marks_ms: float) -> WindowClosed:
    return WindowClosed(epoch=1, bytes=1, chunks=1, expected_chunks=1, contiguous=1, complete=True, rejected={},
                        rejected_in_window={}, marks_ns={k: int(v * MS) for k, v in marks_ms.items()})


def test_each_stage_is_the_time_between_its_two_moments_and_they_add_up() -> None:
    # the window granted at t=10 ms (asked at 9); the link attests from 11 to 12, the verdict at 14, the
    # HANDOFF written at 14.5; the device admits at +5 (15 ms), binds at +5.2, the first chunk is in at +6, the
    # last at +9, and DONE is read at 20 ms
    stats = ProvisionStats(marks_ns={"attest_begun": 11 * MS, "attest_sent": 12 * MS, "verdict": 14 * MS,
                                     "handoff_sent": int(14.5 * MS), "done": 20 * MS})
    got = ho.fixed_stages(window_ns=(9 * MS, 10 * MS), stats=stats,
                          closed=closed(admitted=5, ring_bound=5.2, first_chunk=6, last_chunk=9))
    stages = {k: got[k] for k in (*ho.FIXED_STAGES, "total", "data")}
    assert stages == pytest.approx({"window": 1.0, "attest": 1.0, "verdict": 2.0, "admission": 1.0,
                                    "ring_bind": 0.2, "first_chunk": 0.8, "done": 1.0, "total": 7.0, "data": 3.0})
    assert tuple(k for k in got if k not in ("total", "data", "wall", *ho.STAGE_PARTS)) == ho.FIXED_STAGES
    assert got["wall"] == pytest.approx(11.0)  # the window's request (9 ms) to DONE read (20 ms)


def test_admission_and_done_are_split_by_who_spends_them() -> None:
    # the verdict at 14 ms, the HANDOFF's write begun at 14.2 and flushed at 14.5; the agent took 0.3 ms from the
    # HANDOFF read to its admission sent; the device read the DATA_OPEN at +5.7 (15.7 ms) and admitted at +5.8;
    # the agent built DONE 0.4 ms after the last acknowledgement, read here 1.5 ms after the last chunk
    stats = ProvisionStats(marks_ns={"attest_begun": 14 * MS, "attest_sent": 14 * MS, "verdict": 14 * MS,
                                     "handoff_write": int(14.2 * MS),
                                     "handoff_sent": int(14.5 * MS), "done": int(20.5 * MS)},
                           stages={"admit_sent_s": 0.0003, "ack_to_done_s": 0.0004})
    got = ho.fixed_stages(window_ns=(9 * MS, 10 * MS), stats=stats,
                          closed=closed(admit_read=5.7, admitted=5.8, first_chunk=6, last_chunk=9))
    assert got["admission"] == pytest.approx(1.8) and got["done"] == pytest.approx(1.5)
    assert {k: got[k] for k in ho.STAGE_PARTS} == pytest.approx({
        "admission_wrap": 0.2, "admission_send": 0.3, "admission_agent": 0.3, "admission_device": 0.1,
        "admission_transit": 0.9, "done_agent": 0.4, "done_transit": 1.1})
    # the parts of each stage add up to it, and none is in the total twice
    assert sum(got[k] for k in ho.STAGE_PARTS if k.startswith("admission")) == pytest.approx(got["admission"])
    assert got["total"] == pytest.approx(sum(got[k] for k in ho.FIXED_STAGES))


def test_stages_that_did_not_happen_are_zero_and_a_relay_admitted_early_costs_nothing_after_the_handoff() -> None:
    # no holder attestation, no ring; the relay path admits its connection before the HANDOFF is written
    stats = ProvisionStats(marks_ns={"handoff_sent": 12 * MS, "done": 30 * MS})
    got = ho.fixed_stages(window_ns=(9 * MS, 10 * MS), stats=stats, closed=closed(admitted=1, first_chunk=4,
                                                                                  last_chunk=15))
    assert got["attest"] == got["verdict"] == got["admission"] == got["ring_bind"] == 0
    assert got["first_chunk"] == pytest.approx(2.0) and got["done"] == pytest.approx(5.0)
    assert got["total"] == pytest.approx(1.0 + 2.0 + 5.0)


def test_a_slow_way_back_for_the_grant_does_not_push_the_devices_marks_past_the_agents_done() -> None:
    # the grant took 4 ms to come back (asked at 6, back at 10: a loaded machine); the device's last chunk was in
    # 9 ms after its window opened and DONE is read at 17 ms, so the window opened by 8 ms, not at 10: placed at
    # 10, the last chunk would follow DONE, `done` would clamp to 0 and the stages would exceed the hand-off
    stats = ProvisionStats(marks_ns={"attest_begun": 11 * MS, "attest_sent": 12 * MS, "verdict": 13 * MS,
                                     "handoff_sent": int(13.5 * MS), "done": 17 * MS})
    got = ho.fixed_stages(window_ns=(6 * MS, 10 * MS), stats=stats,
                          closed=closed(admitted=6, first_chunk=7, last_chunk=9))
    assert got["done"] == pytest.approx(0.0) and got["admission"] == pytest.approx(1.0)
    # the stages after the window and the data add up to the hand-off the link timed, attest to DONE
    assert got["total"] - got["window"] + got["data"] == pytest.approx(17.0 - 11.0)


def test_a_visit_with_several_keys_sums_its_hand_offs() -> None:
    one = {k: 1.0 for k in (*ho.FIXED_STAGES, "total", "data", "wall", *ho.STAGE_PARTS)}
    assert ho.add_stages({}, one) == one
    assert ho.add_stages(one, one) == {k: 2.0 for k in one}


def test_window_closed_from_an_older_device_has_no_marks() -> None:
    wire = closed().to_wire()
    del wire["marks_ns"]
    assert WindowClosed.from_wire(wire).marks_ns == {}


def test_a_window_answered_at_completion_ends_its_hand_off_at_that_answer() -> None:
    # the window's request asked at 9 ms and answered at 29 ms (``completion``: the device answered 10 ms after its
    # window opened, so it opened at 9 + (20 - 10) / 2 = 14 ms, the two crossings taken as equal); the relayed
    # HANDOFF's connection admitted at +5 (19 ms), the first chunk in at +6, the last at +9 (23 ms); the agent's
    # DONE, read after, at 40 ms
    stats = ProvisionStats(marks_ns={"done": 29 * MS, "done_read": 40 * MS},
                           stages={"ack_to_done_s": 0.0004})
    got = ho.fixed_stages(window_ns=(9 * MS, 29 * MS), stats=stats,
                          closed=closed(admitted=5, first_chunk=6, last_chunk=9, answered=10))
    stages = {k: got[k] for k in (*ho.FIXED_STAGES, "total", "data", "wall")}
    assert stages == pytest.approx({"window": 5.0, "attest": 0.0, "verdict": 0.0, "admission": 5.0, "ring_bind": 0.0,
                                    "first_chunk": 1.0, "done": 6.0, "total": 17.0, "data": 3.0, "wall": 20.0})
    assert got["done_agent"] == 0.0 and got["done_transit"] == pytest.approx(6.0)  # the DONE is off the path
    assert got["total"] + got["data"] == pytest.approx(got["wall"])
