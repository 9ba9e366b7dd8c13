"""The travel engine end to end: real device service, real agents, faults and operator controls.

Every run here is tiny (2 holders of ~90 KB, 16 KiB chunks, a 0.25 MiB buffer, batch 4 x 32 tokens)
so the whole file stays well under a minute or two on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import WORDS, running, small_settings, started, write_holder

from gputravel.console.cli import main as cli
from gputravel.console.entries import ENTRIES
from gputravel.core import api
from gputravel.core import events as ev
from gputravel.core.api import resolve_holder_dirs
from gputravel.core.config import RunSettings
from gputravel.core.errors import AttestationError, CancelledRunError, ConfigError, DataError
from gputravel.core.ledger import LedgerRow, read_rows, verify_ledger
from gputravel.core.phases import Phase
from gputravel.core.training.checkpoint import CheckpointStore
from gputravel.core.travel import framed_link as holders_mod
from gputravel.core.travel.local_link import LocalHolderLink
from gputravel.core.travel.probes import Timings

pytestmark = pytest.mark.usefixtures("no_leaked_processes")



# --- fixtures and helpers ------------------------------------------------------------------------
# data_root (conftest.py): two holders, ~85 KB of repetitive text each: one 0.25 MiB buffer pass, 6 chunks of 16 KiB.
def small(data: Path, out: Path, **kw: Any) -> RunSettings:
    return small_settings(data, out, **{"allow_fault_injection": True, **kw})


def local_links(settings: RunSettings) -> dict[str, LocalHolderLink]:
    return {name: LocalHolderLink(name, path, agent=ENTRIES.holder_agent, val_fraction=settings.val_fraction)
            for name, path in resolve_holder_dirs(settings)}


def rows_of(out: Path, kind: str | None = None) -> list[LedgerRow]:
    rows = read_rows(out / "ledger.db")
    return [r for r in rows if kind is None or r.kind == kind]


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``gputravel ARGS`` in-process through ``cli.main`` (so exit codes map exactly as installed)."""
    monkeypatch.setattr(sys, "argv", ["gputravel", *args])
    with pytest.raises(SystemExit) as info:
        cli.main()
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


def flat(text: str) -> str:
    """Text without whitespace: rich wraps long paths across lines."""
    return "".join(text.split())


# --- 1. the happy path ---------------------------------------------------------------------------
async def test_full_run_trains_every_visit_and_never_records_a_key(data_root: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys: list[bytes] = []
    original = holders_mod.FramedSession.provision

    async def recording(self: Any, handoff: Any, **kw: Any) -> Any:
        keys.append(handoff.key.key)  # the typed ProvisioningKey's bytes
        return await original(self, handoff, **kw)

    monkeypatch.setattr(holders_mod.FramedSession, "provision", recording)
    events: list[ev.Event] = []
    out = tmp_path / "run"
    report = (await api.run(small(data_root, out, rounds=2, steps_per_visit=10), entries=ENTRIES,
                          sinks=[events.append])).to_json()

    visits = report["visits"]
    assert [v["holder"] for v in visits] == ["alice", "bob", "alice", "bob"]
    assert all(v["outcome"] == "done" for v in visits), visits
    assert all(v["integrity_ok"] and v["scrub_verified"] for v in visits)
    assert all(v["bytes"] > 0 and v["chunks"] >= 5 for v in visits)
    assert len({v["epoch"] for v in visits}) == 4
    assert len({v["key_fingerprint"] for v in visits}) == 4
    assert report["failed_visits"] == 0
    training = report["training"]
    assert training["steps"] == 40
    assert training["loss_last"] < training["loss_first"] - 0.5, training
    assert visits[-1]["loss_last"] < visits[0]["loss_first"]
    assert report["ledger"]["verified"] is True
    assert verify_ledger(out / "ledger.db").ok

    completed = rows_of(out, "visit-completed")
    assert [r.detail["visit"] for r in completed] == [0, 1, 2, 3]
    assert [r.key_fp for r in completed] == [v["key_fingerprint"] for v in visits]
    assert [r.kind for r in rows_of(out)][-1] == "run-completed"
    kinds = Counter(type(e).__name__ for e in events)
    assert kinds["VisitCompleted"] == 4 and kinds["RunCompleted"] == 1 and kinds["VisitFailed"] == 0

    # no provisioning key, in hex or raw, anywhere in the run folder, the report or the events
    assert len(keys) == 4 and len(set(keys)) == 4
    (out / "report.json").write_text(json.dumps(report))
    (out / "events.json").write_text(json.dumps([e.to_dict() for e in events], default=str))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "ledger.db" for p in files)
    assert any(p.parent.name == "checkpoints" for p in files)
    for path in files:
        blob = path.read_bytes()
        for key in keys:
            for needle in (key, key.hex().encode(), key.hex().upper().encode()):
                assert needle not in blob, f"key material in {path}"


# --- 2. a chunk corrupted on the wire ------------------------------------------------------------
async def test_chunk_tampered_on_the_wire_is_rejected_and_retransmitted(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    settings = small(data_root, out, data_path="channel")  # the wire tamper hook lives in the link's relay
    links = local_links(settings)
    links["alice"].session.tamper_on_wire = {0}
    rejected: list[ev.ChunkRejected] = []
    report = (await api.run(settings, links=list(links.values()),
                           sinks=[lambda e: rejected.append(e) if isinstance(e, ev.ChunkRejected) else None])).to_json()

    first, second = report["visits"]
    assert first["outcome"] == "done" and first["integrity_ok"] and first["scrub_verified"]
    assert first["rejected"] == {"tag": 1}
    assert first["retransmits"] == 1
    assert second["outcome"] == "done" and second["rejected"] == {}
    assert report["provisioning"]["rejected"] == {"tag": 1}
    assert [(e.holder, e.seq, e.code) for e in rejected] == [("alice", 0, "tag")]
    rows = rows_of(out, "chunk-rejected")
    assert len(rows) == 1
    assert (rows[0].holder, rows[0].outcome, rows[0].detail["seq"], rows[0].epoch) == ("alice", "tag", 0, 1)
    assert report["ledger"]["verified"]


# --- 3. the holder agent dies mid-transfer -------------------------------------------------------
async def test_agent_killed_mid_transfer_fails_the_visit_scrubs_and_the_run_goes_on(data_root: Path,
                                                                                    tmp_path: Path) -> None:
    out = tmp_path / "run"
    # issue 2's semantics: fail and move on; the kill-after-N-chunks hook counts ACKs in the link's relay
    settings = small(data_root, out, rounds=2, visit_attempts=1, data_path="channel")
    links = local_links(settings)
    links["alice"].session.kill_after_chunks = 1
    report = (await api.run(settings, links=list(links.values()))).to_json()

    v0, v1, v2, v3 = report["visits"]
    assert (v0["outcome"], v0["failed_phase"]) == ("failed", "PROVISION")
    assert v0["scrub_verified"] is True and v0["integrity_ok"] is False and v0["loss_first"] is None
    assert "agent" in v0["error"]
    # the next visit proceeds, and the restarted agent serves alice's next visit
    assert [v["outcome"] for v in (v1, v2, v3)] == ["done", "done", "done"]
    assert v2["holder"] == "alice" and v2["bytes"] > 0
    assert len({v["epoch"] for v in report["visits"]}) == 4
    assert report["failed_visits"] == 1

    failed = rows_of(out, "visit-failed")
    assert len(failed) == 1
    row = failed[0]
    assert (row.holder, row.phase, row.outcome) == ("alice", "PROVISION", "agent")
    assert row.detail["visit"] == 0 and row.detail["scrub_verified"] is True
    assert "restored_checkpoint" not in row.detail  # the model was never at risk
    assert [r.detail["visit"] for r in rows_of(out, "visit-completed")] == [1, 2, 3]
    assert rows_of(out, "run-completed")[0].outcome == "partial"
    assert report["ledger"]["verified"]


def test_cli_exits_9_when_some_visits_failed(data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    original_init = LocalHolderLink.__init__

    def init(self: LocalHolderLink, name: str, *a: Any, **kw: Any) -> None:
        original_init(self, name, *a, **kw)
        if name == "bob":
            self.session.kill_after_chunks = 2

    monkeypatch.setattr(LocalHolderLink, "__init__", init)
    out = tmp_path / "run"
    code, stdout, _err = run_cli(monkeypatch, capsys, "run", "--data", str(data_root), "--holders", "2",
                                 "--transport", "local", "--data-path", "channel",
                                 "--rounds", "1", "--steps-per-visit", "2", "--batch-size", "4", "--seq-len", "32",
                                 "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out), "--json",
                                 "--visit-attempts", "1")
    assert code == 9
    report = json.loads(stdout)
    assert [v["outcome"] for v in report["visits"]] == ["done", "failed"]
    assert report["visits"][1]["failed_phase"] == "PROVISION"
    assert report["failed_visits"] == 1 and report["ledger"]["verified"]


async def test_each_visit_hashes_the_model_once_macs_it_twice_and_checkpoints_hold_the_device_state_once_serialised(
        data_root: Path, tmp_path: Path) -> None:
    """The device hashes the model once at set-up, then per visit only after training; ATTEST and the
    checkpoint reuse that digest. ATTEST takes the model's GMAC under a fresh key as the reference, VERIFY (after
    the holder's key was out) only the GMAC under that key (issue 23 item 3). A checkpoint holds the chunks the
    device sealed (a trainer state), stored unopened."""
    out = tmp_path / "run"
    timings = Timings()
    async with started(small(data_root, out)) as engine:
        engine.bus.probes.append(timings)
        report = (await engine.run()).to_json()
        counters = (await asyncio.to_thread(engine.device.client.stats)).counters
        record = engine.ckpts.store.meta(engine.ckpts.last_good)
        state = CheckpointStore.over(engine.ckpts.store).load(engine.ckpts.last_good, run_id=report["run_id"])
    visits = len(report["visits"])
    assert all(v["outcome"] == "done" for v in report["visits"])
    assert counters["model_digests"] == 1 + visits
    assert counters["model_macs"] == 2 * visits
    assert counters["measurements"] == 1 + 2 * visits  # each ATTEST and VERIFY still measures
    verified = rows_of(out, "phase")
    verify_rows = [r for r in verified if r.phase == "VERIFY"]
    assert len(verify_rows) == visits and all(r.detail["check"] == "mac" for r in verify_rows)
    assert record["model_digest"] == report["training"]["model_digest"] and record["seq"] == visits
    assert {"model", "optimizer", "step"} <= set(state) and state["step"] == report["training"]["steps"]
    # the probe saw every phase of every visit, the checkpoints and the holders' start
    assert {str(p) for p in timings.phase_s[0]} == {str(p) for p in Phase if p not in (Phase.DONE, Phase.FAILED)}
    assert set(timings.checkpoint_s) == set(range(visits + 1)) and set(timings.visit_wall_s) == set(range(visits))
    assert timings.deploy_wall_s() is not None and set(timings.holder_started) == {"alice", "bob"}


# --- 4. integrity mismatch -----------------------------------------------------------------------
async def test_integrity_mismatch_fails_the_visit_and_restores_the_last_good_checkpoint(data_root: Path,
                                                                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    seen: dict[str, Any] = {}
    async with started(small(data_root, out, visit_attempts=1)) as engine:
        engine.fault["VERIFY"] = lambda e: e.device.client.tamper(region="model")

        def on_failed(event: ev.Event) -> None:
            if isinstance(event, ev.VisitFailed):  # emitted after the restore: compare device and checkpoint
                seen["device_model"] = engine.device.client.measure().model
                seen["ckpt_seq"] = engine.ckpts.last_good
                seen["ckpt_model"] = engine.ckpts.store.meta(engine.ckpts.last_good)["model_digest"]
                seen["event"] = event

        engine.bus.sinks.append(on_failed)
        report = (await engine.run()).to_json()

    v0, v1 = report["visits"]
    assert (v0["outcome"], v0["failed_phase"]) == ("failed", "VERIFY")
    assert v0["integrity_ok"] is False and v0["scrub_verified"] is True and v0["loss_first"] is None
    assert "model region changed" in v0["error"]
    assert seen["event"].code == "integrity"
    assert seen["ckpt_seq"] == 0
    assert seen["device_model"] == seen["ckpt_model"]
    # the next visit's ATTEST measurement passes against the restored model, and it trains
    assert v1["outcome"] == "done" and v1["integrity_ok"] and v1["loss_first"] is not None
    failed = rows_of(out, "visit-failed")
    assert len(failed) == 1
    assert (failed[0].phase, failed[0].outcome) == ("VERIFY", "integrity")
    assert failed[0].detail["restored_checkpoint"] == 0
    assert failed[0].detail["scrub_verified"] is True


async def test_a_restore_waits_for_the_checkpoint_in_flight_and_restores_it(data_root: Path, tmp_path: Path) -> None:
    """Visit 0's checkpoint is still being written (held here until someone waits for it) when visit 1's VERIFY finds
    the model tampered with: the restore waits for that checkpoint and restores it (visit 0's training kept and
    committed), not the one before it. Restoring the older one while visit 0 stayed committed lost its training."""
    out = tmp_path / "run"
    async with started(small(data_root, out, visit_attempts=1)) as engine:
        gate = asyncio.Event()
        persist = engine.ckpts._persist

        holding: list[int] = []

        async def held(seq: int, *args: Any) -> None:  # visit 0's checkpoint waits for visit 1's failure
            if seq == 1:
                holding.append(seq)
                await asyncio.wait_for(gate.wait(), 60)
            await persist(seq, *args)

        settle = engine.ckpts.settle

        async def settle_released() -> None:  # the first wait for the held checkpoint lets it go on
            if holding:
                gate.set()
            await settle()

        engine.ckpts._persist = held  # type: ignore[method-assign]
        engine.ckpts.settle = settle_released  # type: ignore[method-assign]

        def tamper(e: Any) -> None:
            e.device.client.tamper(region="model")

        engine.fault["VERIFY"] = lambda e: e.fault.__setitem__("VERIFY", tamper)  # visit 1's VERIFY
        report = (await engine.run()).to_json()
        device_model = engine.device.client.measure().model
        ckpt1_model = engine.ckpts.store.meta(1)["model_digest"]

    v0, v1 = report["visits"]
    assert v0["outcome"] == "done" and (v1["outcome"], v1["failed_phase"]) == ("failed", "VERIFY")
    failed = rows_of(out, "visit-failed")
    assert len(failed) == 1 and failed[0].detail["restored_checkpoint"] == 1
    assert device_model == ckpt1_model == report["training"]["model_digest"]
    assert not rows_of(out, "visit-undone")
    assert report["ledger"]["verified"]


# --- 5. operator controls ------------------------------------------------------------------------
async def next_event(q: asyncio.Queue[ev.Event], kind: type[ev.Event], timeout: float = 60) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            event = await q.get()
            if isinstance(event, kind):
                return event


async def wait_until(cond: Callable[[], bool], timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def drain(q: asyncio.Queue[ev.Event]) -> list[ev.Event]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


async def test_breakpoint_step_and_resume(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with started(small(data_root, out, breakpoints=("HANDOFF",))) as engine:
        q = engine.subscribe()
        async with running(engine) as task:
            paused = await next_event(q, ev.RunPaused)
            assert (paused.reason, paused.next_phase) == ("breakpoint", "HANDOFF")
            assert engine.control.paused and engine.control.paused_at == Phase.HANDOFF
            before = drain(q)
            assert not any(isinstance(e, ev.PhaseStarted) and e.phase == "HANDOFF" for e in before)
            await asyncio.sleep(0.2)  # paused means paused
            assert not any(isinstance(e, ev.PhaseStarted) for e in drain(q))

            engine.control.step()  # exactly one phase: HANDOFF, then pause before PROVISION
            await wait_until(lambda: engine.control.paused_at == Phase.PROVISION)
            started_phases = [e.phase for e in drain(q) if isinstance(e, ev.PhaseStarted)]
            assert started_phases == ["HANDOFF"]
            await asyncio.sleep(0.2)
            assert not any(isinstance(e, ev.PhaseStarted) for e in drain(q))

            engine.control.resume()  # visit 0 finishes; the breakpoint stops visit 1 before its HANDOFF
            paused = await next_event(q, ev.RunPaused)
            assert paused.next_phase == "HANDOFF" and engine.control.paused_at == Phase.HANDOFF
            assert engine.walk.records[0].outcome == "done"
            assert engine.control.toggle_breakpoint(Phase.HANDOFF) is False  # cleared
            engine.control.resume()
            report = (await asyncio.wait_for(task, 60)).to_json()
    assert [v["outcome"] for v in report["visits"]] == ["done", "done"]
    assert report["ledger"]["verified"]


async def test_cancel_during_a_pause_ends_the_run_and_scrubs_the_partial_buffer(data_root: Path,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with started(small(data_root, out, breakpoints=("TRAIN",))) as engine:
        q = engine.subscribe()
        task = asyncio.create_task(engine.run())
        paused = await next_event(q, ev.RunPaused)
        assert paused.next_phase == "TRAIN" and engine.control.paused_at == Phase.TRAIN
        assert engine.walk.records[0].bytes > 0  # the holder's data sits in the buffer
        engine.control.cancel()
        with pytest.raises(CancelledRunError):
            await asyncio.wait_for(task, 60)
        events = drain(q)
    assert any(isinstance(e, ev.RunFailed) and e.code == "cancelled" for e in events)
    assert not any(isinstance(e, ev.PhaseStarted) and e.phase == "TRAIN" for e in events)
    assert engine.walk.records[0].outcome == "cancelled"
    cancelled = rows_of(out, "visit-cancelled")
    assert len(cancelled) == 1
    assert cancelled[0].holder == "alice" and cancelled[0].outcome == "cancelled"
    assert cancelled[0].detail["scrub_verified"] is True
    last = [r for r in rows_of(out) if r.kind != "holder-state"][-1]  # agents report "stopped" after the run
    assert last.kind == "run-failed" and last.outcome == "cancelled"
    assert rows_of(out, "visit-completed") == []
    assert verify_ledger(out / "ledger.db").ok


# --- 6. resume -----------------------------------------------------------------------------------
async def test_resume_continues_a_cancelled_run_without_repeating_visits(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    settings = small(data_root, out, rounds=2)
    async with started(settings) as engine:
        def cancel_after_first(event: ev.Event) -> None:
            if isinstance(event, ev.VisitCompleted) and event.visit == 0:
                engine.control.cancel()

        engine.bus.sinks.append(cancel_after_first)
        with pytest.raises(CancelledRunError):
            await engine.run()
    assert [r.detail["visit"] for r in rows_of(out, "visit-completed")] == [0]

    with pytest.raises(ConfigError, match="already holds a run"):
        await api.run(settings, entries=ENTRIES)

    report = (await api.run(small(data_root, out, rounds=2, resume=True), entries=ENTRIES)).to_json()
    outcomes = [v["outcome"] for v in report["visits"]]
    assert outcomes == ["done (earlier run)", "done", "done", "done"]
    assert report["visits"][0]["loss_first"] is None  # not trained again
    assert report["failed_visits"] == 0
    assert report["training"]["steps"] == 8  # the counter continues from the checkpoint
    per_visit = Counter(r.detail["visit"] for r in rows_of(out, "visit-completed"))
    assert per_visit == {0: 1, 1: 1, 2: 1, 3: 1}
    assert len({r.run_id for r in rows_of(out)}) == 2
    assert len(rows_of(out, "resumed")) == 1
    epochs = [r.epoch for r in rows_of(out, "visit-completed")]
    assert len(set(epochs)) == 4  # a resumed run never reuses an epoch
    assert report["ledger"]["verified"] and verify_ledger(out / "ledger.db").ok


# --- 7. bad input at the edges -------------------------------------------------------------------
@pytest.fixture
def bad_data(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (the --data folder, the path the error must name)."""
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    (flat_dir / "notes.md").write_text("no holder folders here\n")
    mixed = tmp_path / "mixed"
    write_holder(mixed / "alice", 1, WORDS, 200)
    write_holder(mixed / "bob", 2, WORDS, 200)
    (mixed / "bob" / "tokens.bin").write_bytes(b"\0" * 1024)
    empty = tmp_path / "empty"
    write_holder(empty / "alice", 1, WORDS, 200)
    (empty / "bob").mkdir()
    return {"no subfolders": (flat_dir, flat_dir), "mixed formats": (mixed, mixed / "bob"),
            "empty holder": (empty, empty / "bob")}


@pytest.mark.parametrize("case", ["no subfolders", "mixed formats", "empty holder"])
async def test_malformed_data_folder_is_a_data_error(case: str, bad_data: dict[str, tuple[Path, Path]],
                                                     tmp_path: Path) -> None:
    data, culprit = bad_data[case]
    with pytest.raises(DataError) as info:
        await api.run(small(data, tmp_path / "out"), entries=ENTRIES)
    assert str(culprit) in str(info.value)


@pytest.mark.parametrize("case", ["no subfolders", "mixed formats", "empty holder"])
def test_cli_malformed_data_folder_exits_2_naming_the_path(case: str, bad_data: dict[str, tuple[Path, Path]],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    data, culprit = bad_data[case]
    code, _out, err = run_cli(monkeypatch, capsys, "run", "--data", str(data), "--holders", "2",
                              "--out", str(tmp_path / "out"))
    assert code == 2, err
    assert str(culprit) in flat(err)


async def test_device_in_devtools_mode_fails_attestation(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(AttestationError, match="devtools"):
        await api.run(small(data_root, out, cc_mode="devtools"), entries=ENTRIES)
    rows = rows_of(out)
    assert [r.kind for r in rows] == ["run-failed"]
    assert rows[0].outcome == "attestation"
    assert rows_of(out, "holder-connected") == []  # no holder ever saw a key or the buffer


def test_cli_devtools_device_exits_3(data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(monkeypatch, capsys, "run", "--data", str(data_root), "--holders", "2",
                              "--cc-mode", "devtools", "--out", str(tmp_path / "run"))
    assert code == 3, err
    assert "devtools" in err
