"""Cancel and pause inside PROVISION: a cancel lands at the next acknowledged chunk (the visit is cancelled
and its partial buffer scrubbed, long before the window would have filled); a pause lands between two of
the window's provisioning keys (no holder key is live while paused), then the visit goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import running, started, write_holder

from gputravel.core import events as ev
from gputravel.core.config import RunSettings
from gputravel.core.errors import CancelledRunError
from gputravel.core.ledger import read_rows, verify_ledger

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

WORDS = "the quick brown fox jumps over a lazy dog while cat and bird sat on the warm mat".split()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_holder(root / "alice", 1, WORDS, n_words=200_000)  # about 1 MB: a window of hundreds of chunks
    write_holder(root / "bob", 2, WORDS, n_words=200_000)
    return root


def big_provisioning(data: Path, out: Path, **kw: Any) -> RunSettings:
    base: dict[str, Any] = dict(holders=2, rounds=1, steps_per_visit=2, batch_size=4, seq_len=32, chunk_kib=4,
                                buffer_mib=2, data_dir=data, out_dir=out)
    base.update(kw)
    return RunSettings(**base)


async def test_cancel_mid_provision_lands_at_the_next_chunk_and_scrubs(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    events: list[ev.Event] = []
    async with started(big_provisioning(data_root, out)) as engine:

        def cancel_at_first_progress(event: ev.Event) -> None:
            events.append(event)
            if isinstance(event, ev.ProvisionProgressed) and not engine.control.cancelled:
                engine.control.cancel()  # 4 chunks in (progress comes every 4th acknowledged chunk)

        engine.bus.sinks.append(cancel_at_first_progress)
        with pytest.raises(CancelledRunError):
            await engine.run()

    window = engine.walk.records[0].plan.window_len
    assert window >= 200 * 4096  # a provisioning of hundreds of chunks
    progress = [e for e in events if isinstance(e, ev.ProvisionProgressed)]
    asked, = [e for e in events if isinstance(e, ev.ControlRequested)]
    cancelled, = [e for e in events if isinstance(e, ev.VisitCancelled)]
    assert (asked.action, asked.phase) == ("cancel", "PROVISION")
    # it landed at the next acknowledged chunk: no progress after the request, the window far from full
    assert [e.nbytes for e in progress] == [4 * 4096]
    assert events.index(asked) < events.index(cancelled)
    assert (cancelled.visit, cancelled.phase, cancelled.steps, cancelled.scrub_verified) == (0, "PROVISION", 0, True)
    assert not any(isinstance(e, ev.PhaseCompleted) and e.phase == "PROVISION" for e in events)
    assert not any(isinstance(e, ev.PhaseStarted) and e.phase == "RETURN" for e in events)
    rows = read_rows(out / "ledger.db")
    row, = [r for r in rows if r.kind == "visit-cancelled"]
    assert (row.phase, row.outcome) == ("PROVISION", "cancelled") and row.detail["scrub_verified"] is True
    assert [r.outcome for r in rows if r.kind == "run-failed"][-1] == "cancelled"
    assert verify_ledger(out / "ledger.db").ok


async def test_pause_mid_provision_lands_between_keys_then_resumes(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # 32 chunks per key: the window is provisioned under several keys, one after another
    async with started(big_provisioning(data_root, out, key_chunk_budget=32)) as engine:
        q = engine.subscribe()
        asked_once: list[bool] = []

        def pause_at_first_progress(event: ev.Event) -> None:
            if isinstance(event, ev.ProvisionProgressed) and not asked_once:
                asked_once.append(True)
                engine.control.pause()

        engine.bus.sinks.append(pause_at_first_progress)
        async with running(engine) as task:
            seen: list[ev.Event] = []
            async with asyncio.timeout(120):
                while not isinstance(seen[-1:] and seen[-1], ev.RunPaused):
                    seen.append(await q.get())
            asked, = [e for e in seen if isinstance(e, ev.ControlRequested)]
            paused = seen[-1]
            assert isinstance(paused, ev.RunPaused)
            n_keys = -(-engine.walk.records[0].plan.window_len // (32 * 4096))
            assert n_keys >= 3
            assert (asked.action, asked.phase) == ("pause", "PROVISION")
            assert (paused.reason, paused.next_phase, paused.within) == ("paused", "PROVISION",
                                                                         f"PROVISION key 1/{n_keys}")
            # paused between keys: the first key's 32 chunks arrived, its window is closed, nothing moves
            done = [e.nbytes for e in seen if isinstance(e, ev.ProvisionProgressed)]
            assert done[-1] == 32 * 4096
            await asyncio.sleep(0.3)
            assert not any(isinstance(e, ev.ProvisionProgressed) for e in _drain(q))
            engine.control.resume()
            report = (await asyncio.wait_for(task, 120)).to_json()
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    assert report["ledger"]["verified"]


async def test_a_pause_before_provision_is_not_counted_in_the_visits_transfer(tmp_path: Path) -> None:
    """Operator walk (session 15): stepping a run in the console, a visit paused before PROVISION read
    ``provisioned at 0.88 MB/s``, the operator's two seconds counted in its Tx (measured from its window's request
    at HANDOFF). The pause is left out: the visit's Tx is shorter than the pause it waited through."""
    data = tmp_path / "data"
    write_holder(data / "alice", 1, WORDS, n_words=2_000)
    settings = RunSettings(holders=1, rounds=1, steps_per_visit=1, batch_size=4, seq_len=32, chunk_kib=4,
                           buffer_mib=1, data_dir=data, out_dir=tmp_path / "run", breakpoints=("PROVISION",))
    async with started(settings) as engine:
        q = engine.subscribe()
        async with running(engine) as task:
            seen: list[ev.Event] = []
            async with asyncio.timeout(120):
                while not isinstance(seen[-1:] and seen[-1], ev.RunPaused):
                    seen.append(await q.get())
            assert isinstance(seen[-1], ev.RunPaused) and seen[-1].next_phase == "PROVISION"
            await asyncio.sleep(2.0)  # the operator reads the screen
            engine.control.resume()
            report = (await asyncio.wait_for(task, 120)).to_json()
    (visit,) = report["visits"]
    assert visit["outcome"] == "done" and visit["bytes"] > 0
    assert engine.control.paused_ns >= 2_000_000_000
    assert visit["provision_s"] < 2.0, visit["provision_s"]  # was the pause and the transfer: above 2 s


def _drain(q: asyncio.Queue[ev.Event]) -> list[ev.Event]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_the_console_says_a_cancel_in_provision_lands_at_the_next_chunk_and_no_steps_ran() -> None:
    from gputravel.console.tui.screens.base import summarise
    from gputravel.console.view.model import RunState

    state = RunState()
    t = 1000.0
    for event in (ev.RunStarted(t, "r1", {"kind": "emulated"}, ("alice",), 1),
                  ev.PhaseStarted(t, 0, "alice", "PROVISION", 1),
                  ev.ControlRequested(t, "cancel", "PROVISION")):
        state.apply(event)
    assert summarise(state, "travel", ()).status == "cancelling..."
    assert state.oplog[-1].text == "cancel asked during PROVISION: lands at the next chunk"
    state.apply(ev.VisitCancelled(t, 0, "alice", 1, "PROVISION", 0, True))
    assert state.oplog[-1].text == "visit 1 cancelled in PROVISION; scrub verified"  # no "after 0 steps"
    state.apply(ev.RunFailed(t, "r1", "cancelled by the operator", "cancelled"))
    visit = state.visit(0)
    assert visit is not None and (visit.outcome, visit.scrub_verified) == ("cancelled", True)
