"""A holder's witness of the audit ledger: the head the orchestrator stated at each hand-off, kept by the
holder's agent in its own file, later proves the ledger was neither cut short nor rewritten."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from helpers import small_settings, write_holder
from typer.testing import CliRunner

from gputravel.console.cli.main import app
from gputravel.console.entries import ENTRIES
from gputravel.core import api
from gputravel.core.ledger import Ledger, parse_head, read_rows, verify_ledger
from gputravel.core.travel.local_link import LocalHolderLink

runner = CliRunner()


async def test_each_hand_off_leaves_the_ledger_head_with_the_holder_and_a_cut_ledger_is_caught(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    words = "witness of the ledger head kept by each holder at every hand off".split()
    write_holder(data / "alice", 1, words)
    write_holder(data / "bob", 2, words)
    out = tmp_path / "run"
    settings = small_settings(data, out, rounds=2, steps_per_visit=1, transport="local")
    witness = {name: tmp_path / "holders" / name / "witness.jsonl" for name in ("alice", "bob")}
    links = [LocalHolderLink(name, data / name, agent=ENTRIES.holder_agent, val_fraction=settings.val_fraction, witness=witness[name])
             for name in ("alice", "bob")]
    report = (await api.run(settings, links=links)).to_json()
    assert report["failed_visits"] == 0

    db = out / "ledger.db"
    rows = list(read_rows(db))
    last_visit = max(r.seq for r in rows if r.kind == "visit-completed")
    for name, path in witness.items():
        assert path.stat().st_mode & 0o777 == 0o600
        *records, end = [json.loads(line) for line in path.read_text().splitlines()]
        # the farewell: the head once the run lets the holder go, covering every visit's rows
        assert end["at"] == "end" and parse_head(end["ledger_head"])[0] >= last_visit
        assert all(r["at"] == "hand-off" for r in records)
        handoffs = [r for r in rows if r.kind == "phase" and r.phase == "HANDOFF" and r.holder == name]
        assert [r["epoch"] for r in records] == [r.epoch for r in handoffs]  # one record per hand-off
        heads = [parse_head(r["ledger_head"]) for r in records]
        assert heads == sorted(heads) and len({seq for seq, _ in heads}) == len(heads)
        for (seq, digest), handoff in zip(heads, handoffs, strict=True):
            assert seq < handoff.seq  # stated before the hand-off's own row was written
            assert next(r.hash for r in rows if r.seq == seq) == digest
        ok = runner.invoke(app, ["ledger", "verify", str(db), "--witness", str(path)], env={"COLUMNS": "200"})
        assert ok.exit_code == 0 and f"holds all {len(heads) + 1} witnessed heads" in ok.output, ok.output

    # the operator cuts the ledger back to before bob's last hand-off: the chain still verifies on its own,
    # but bob's witness shows the cut
    last_bob = parse_head(json.loads(witness["bob"].read_text().splitlines()[-2])["ledger_head"])[0]
    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM events WHERE seq >= ?", (last_bob,))
    con.close()
    assert verify_ledger(db).ok
    cut = runner.invoke(app, ["ledger", "verify", str(db), "--witness", str(witness["bob"])],
                        env={"COLUMNS": "200"})
    assert cut.exit_code == 8 and "truncated" in cut.output, cut.output


async def test_the_farewell_head_covers_the_last_visit(tmp_path: Path) -> None:
    """Cutting only the run's last rows (after every hand-off) is caught by the head sent with the farewell."""
    data = tmp_path / "data"
    write_holder(data / "alice", 3, "only the last visit of a run is covered by the farewell head".split())
    out = tmp_path / "run"
    settings = small_settings(data, out, holders=1, steps_per_visit=1, transport="local")
    path = tmp_path / "alice-witness.jsonl"
    await api.run(settings, links=[LocalHolderLink("alice", data / "alice", agent=ENTRIES.holder_agent, witness=path)])
    handoff, end = [json.loads(line) for line in path.read_text().splitlines()]
    db = out / "ledger.db"
    visit_done = max(r.seq for r in read_rows(db) if r.kind == "visit-completed")
    assert parse_head(handoff["ledger_head"])[0] < visit_done <= parse_head(end["ledger_head"])[0]
    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM events WHERE seq >= ?", (visit_done,))
    con.close()
    assert verify_ledger(db, expect_heads=[parse_head(handoff["ledger_head"])]).ok  # the hand-off alone misses it
    assert "truncated" in (verify_ledger(db, expect_heads=[parse_head(end["ledger_head"])]).reason or "")


def test_a_malformed_witness_file_is_a_usage_error(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    Ledger.open(db, run_id="run-malformed-witness").close()  # a real (empty) ledger: the witness is what is wrong
    witness = tmp_path / "witness.jsonl"
    witness.write_text('{"ledger_head": "not a head"}\n')
    result = runner.invoke(app, ["ledger", "verify", str(db), "--witness", str(witness)])
    assert result.exit_code == 2 and "line 1 is not a witness record" in result.output


async def test_a_witness_kept_over_two_runs_verifies_both_ledgers(tmp_path: Path) -> None:
    """Issue 30: the witness keeps heads per run; after a holder's second run, each run's ledger verifies against
    the one witness file (it used to say "the chain was rewritten" for both)."""
    data = tmp_path / "data"
    write_holder(data / "alice", 4, "two runs one witness file per holder kept across runs".split())
    path = tmp_path / "alice-witness.jsonl"
    outs = [tmp_path / "run-1", tmp_path / "run-2"]
    for out in outs:
        settings = small_settings(data, out, holders=1, steps_per_visit=1, transport="local")
        await api.run(settings, links=[LocalHolderLink("alice", data / "alice", agent=ENTRIES.holder_agent,
                                                       witness=path)])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    runs = [read_rows(out / "ledger.db")[0].run_id for out in outs]
    assert [r["run"] for r in records] == [runs[0], runs[0], runs[1], runs[1]]  # hand-off and end, per run
    for out in outs:
        ok = runner.invoke(app, ["ledger", "verify", str(out / "ledger.db"), "--witness", str(path)],
                           env={"COLUMNS": "200"})
        assert ok.exit_code == 0 and "holds all 2 witnessed heads" in ok.output, ok.output
