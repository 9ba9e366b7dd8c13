"""The visit state machine (core/phases.py) against the protocol it encodes.

Expectations are written from the protocol in DESIGN.md ("The protocol (one visit)") and the module's own
contract, not copied from ``TRANSITIONS``:

- one visit runs, in this order: fresh attestation, hand-off of a provisioning key, provisioning, return
  (the holder's key dies), integrity check of code and model, training, scrub of the buffer, key rotation,
  and then it is done;
- any phase of a running visit may fail; a failed visit always goes to SCRUB (a partial buffer is scrubbed)
  and ends through ROTATE, so the next holder gets a fresh epoch;
- DONE is terminal.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gputravel.core.errors import GpuTravelError
from gputravel.core.phases import (
    TRANSITIONS,
    VISIT_PHASES,
    Phase,
    TransitionError,
    check_transition,
)

#: The protocol order of one visit, by phase name (DESIGN.md steps 2-7, preceded by the per-visit
#: re-attestation and followed by the key rotation that ends a visit).
PROTOCOL_ORDER = ("ATTEST", "HANDOFF", "PROVISION", "RETURN", "VERIFY", "TRAIN", "SCRUB", "ROTATE", "DONE")
HAPPY_PATH = [Phase(name) for name in PROTOCOL_ORDER]
RUNNING = HAPPY_PATH[:-1]  # every phase in which work is under way (and so may fail)


def expected_legal() -> set[tuple[Phase, Phase]]:
    legal = set(itertools.pairwise(HAPPY_PATH))  # the protocol, one step at a time
    legal |= {(p, Phase.FAILED) for p in RUNNING}  # any running phase may fail
    legal.add((Phase.FAILED, Phase.SCRUB))  # a failed visit scrubs the buffer (then ROTATE, DONE)
    return legal


ALL_PAIRS = list(itertools.product(Phase, Phase))
LEGAL = expected_legal()
ILLEGAL = [pair for pair in ALL_PAIRS if pair not in LEGAL]


def test_the_phase_set_is_the_protocol_plus_failed() -> None:
    assert {str(p) for p in Phase} == {*PROTOCOL_ORDER, "FAILED"}
    assert set(TRANSITIONS) == set(Phase), "every phase needs an entry, even a terminal one"
    # the phases a visit shows (console timeline, crash study) are the protocol's, in its order
    assert [str(p) for p in VISIT_PHASES] == list(PROTOCOL_ORDER[:-1])


@pytest.mark.parametrize("src, dst", sorted(LEGAL), ids=lambda p: str(p))
def test_every_legal_transition_passes(src: Phase, dst: Phase) -> None:
    check_transition(src, dst)


@pytest.mark.parametrize("src, dst", ILLEGAL, ids=lambda p: str(p))
def test_every_other_transition_is_refused(src: Phase, dst: Phase) -> None:
    with pytest.raises(TransitionError, match=f"illegal transition {src} -> {dst}"):
        check_transition(src, dst)


@pytest.mark.parametrize("src, dst, why", [
    (Phase.ATTEST, Phase.TRAIN, "training before any data was provisioned"),
    (Phase.TRAIN, Phase.HANDOFF, "a new key handed out before the buffer is scrubbed"),
    (Phase.PROVISION, Phase.TRAIN, "training before the holder's key is dead and the model checked"),
    (Phase.RETURN, Phase.TRAIN, "training without the integrity check"),
    (Phase.VERIFY, Phase.SCRUB, "skipping training is not a protocol path"),
    (Phase.TRAIN, Phase.ROTATE, "rotating without a scrub leaves the data in the buffer"),
    (Phase.SCRUB, Phase.HANDOFF, "the next hand-off comes after the rotation, in the next visit"),
    (Phase.HANDOFF, Phase.ATTEST, "going backwards"),
    (Phase.FAILED, Phase.ROTATE, "a failed visit must scrub first"),
    (Phase.FAILED, Phase.DONE, "a failed visit must scrub first"),
    (Phase.FAILED, Phase.TRAIN, "no training on a failed visit's buffer"),
    (Phase.FAILED, Phase.FAILED, "failing twice"),
    (Phase.DONE, Phase.ATTEST, "DONE is terminal (the engine starts each visit afresh)"),
    (Phase.DONE, Phase.FAILED, "DONE is terminal"),
])
def test_protocol_violations_are_refused(src: Phase, dst: Phase, why: str) -> None:
    with pytest.raises(TransitionError) as info:
        check_transition(src, dst)
    err = info.value
    assert isinstance(err, GpuTravelError) and err.code == "transition", why
    assert str(src) in str(err) and str(dst) in str(err)


@pytest.mark.parametrize("failing", RUNNING, ids=str)
def test_a_failure_in_any_phase_ends_through_scrub_and_rotate(failing: Phase) -> None:
    """The failure path: <phase> -> FAILED -> SCRUB -> ROTATE -> DONE, each step legal."""
    path = [*HAPPY_PATH[:HAPPY_PATH.index(failing) + 1], Phase.FAILED, Phase.SCRUB, Phase.ROTATE, Phase.DONE]
    for src, dst in itertools.pairwise(path):
        check_transition(src, dst)


def test_no_path_reaches_train_without_provision_verify_or_skips_scrub() -> None:
    """Reachability over the real table: TRAIN only after VERIFY; ROTATE only after a SCRUB; no cycles
    back into the data phases once a visit failed."""

    def reachable(start: Phase, *, avoiding: Phase) -> set[Phase]:
        seen, todo = set(), [start]
        while todo:
            p = todo.pop()
            for q in TRANSITIONS[p]:
                if q != avoiding and q not in seen:
                    seen.add(q)
                    todo.append(q)
        return seen

    assert Phase.TRAIN not in reachable(Phase.ATTEST, avoiding=Phase.VERIFY)
    assert Phase.TRAIN not in reachable(Phase.ATTEST, avoiding=Phase.PROVISION)
    assert Phase.ROTATE not in reachable(Phase.ATTEST, avoiding=Phase.SCRUB)
    assert Phase.DONE not in reachable(Phase.ATTEST, avoiding=Phase.ROTATE)
    after_failure = reachable(Phase.FAILED, avoiding=Phase.DONE)
    assert after_failure.isdisjoint({Phase.HANDOFF, Phase.PROVISION, Phase.RETURN, Phase.VERIFY, Phase.TRAIN})
    assert Phase.DONE in reachable(Phase.FAILED, avoiding=Phase.ATTEST)


class FakeClosingLink:
    """A holder link isolated to its ``close``: the first close of a ``slow`` one hangs until cancelled."""

    def __init__(self, name: str, *, slow: bool = False) -> None:
        self.name, self.slow, self.closes, self.closed = name, slow, 0, False
        self.farewell_head: object = None
        self.farewell_rows: object = None
        self.closing = asyncio.Event()

    async def close(self) -> None:
        self.closes += 1
        self.closing.set()
        if self.slow and self.closes == 1:
            await asyncio.Event().wait()
        self.closed = True


class FakeAudit:
    def head(self) -> str:
        return "head"

    def visit_rows(self) -> dict[str, dict[int, str]]:
        return {"alice": {1: "h1"}}


async def test_a_run_cancelled_while_its_holders_say_goodbye_still_closes_every_holder() -> None:
    """The console leaving cancels its run's worker; if that lands while the first holder's link closes, the
    other holders' agents were left running (they outlived the test: no_leaked_processes)."""
    import types

    from gputravel.core.travel.engine import TravelEngine

    alice, bob = FakeClosingLink("alice", slow=True), FakeClosingLink("bob")
    engine = types.SimpleNamespace(audit=FakeAudit(), links={"alice": alice, "bob": bob})
    task = asyncio.ensure_future(TravelEngine._shutdown_links(engine))
    await asyncio.wait_for(alice.closing.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bob.closed and alice.closed and alice.closes == 2
    assert alice.farewell_rows == {1: "h1"} and bob.farewell_rows == {} and bob.farewell_head == "head"
