"""A holder whose data does not fit the GPU buffer is provisioned in parts: a real engine run.

tests/core/test_planner.py checks the schedule on paper; this runs it: the real device service, real agents on the
local transport, a tiny model, and a 32 KiB buffer so one holder takes three parts and the other two, over two
rounds. Everything is checked from what the run leaves behind (report, ledger) plus the hand-offs the holders
were given.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers import write_holder

from gputravel.console.entries import ENTRIES
from gputravel.core import api
from gputravel.core.config import RunSettings
from gputravel.core.ledger import read_rows, verify_ledger
from gputravel.core.travel import framed_link as holders_mod

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

WORDS = "the quick brown fox jumps over a lazy dog while cat and bird sat on the warm mat".split()
BUFFER_MIB = 1 / 32  # 32 KiB: ~29 KiB of training data per visit next to the held-out slice
ROUNDS = 2


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """alice ~85 KB of text (three buffers' worth), bob ~48 KB (two)."""
    root = tmp_path_factory.mktemp("data")
    write_holder(root / "alice", 1, WORDS, n_words=16_000)
    write_holder(root / "bob", 2, WORDS, n_words=9_000)
    return root


async def test_holders_bigger_than_the_buffer_travel_in_parts(data_root: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    handoffs: dict[int, list[Any]] = defaultdict(list)  # epoch -> the hand-offs under it
    original = holders_mod.FramedSession.provision

    async def recording(self: Any, handoff: Any, **kw: Any) -> Any:
        handoffs[handoff.epoch].append((self.name, handoff.train, handoff.val, handoff.skip, handoff.length))
        return await original(self, handoff, **kw)

    monkeypatch.setattr(holders_mod.FramedSession, "provision", recording)
    out = tmp_path / "run"
    settings = RunSettings(holders=2, rounds=ROUNDS, steps_per_visit=1, batch_size=2, seq_len=16, chunk_kib=8,
                           buffer_mib=BUFFER_MIB, data_dir=data_root, out_dir=out, transport="local")
    report = (await api.run(settings, entries=ENTRIES)).to_json()
    buffer_bytes = settings.buffer_bytes

    # every visit ran to the end, with its integrity check and scrub
    visits = report["visits"]
    assert report["failed_visits"] == 0 and report["retried_visits"] == 0
    assert all(v["outcome"] == "done" and v["integrity_ok"] and v["scrub_verified"] for v in visits), visits
    assert len({v["epoch"] for v in visits}) == len(visits)  # a fresh key per part
    assert report["ledger"]["verified"] and verify_ledger(out / "ledger.db").ok

    holders = {h["name"]: h for h in report["holders"]}
    assert set(holders) == {"alice", "bob"}
    for name, h in holders.items():  # the agent counts exactly the holder's data, split train / held-out
        assert h["train_bytes"] + h["val_bytes"] == (data_root / name / "part.txt").stat().st_size
        assert h["train_bytes"] > buffer_bytes  # so it cannot travel in one visit

    # each holder's parts appear as 1/N .. N/N in every round, N >= 2, holders interleaved round-robin
    by_round_holder: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for v in visits:
        by_round_holder[(v["round"], v["holder"])].append(v)
    assert set(by_round_holder) == {(r, h) for r in range(ROUNDS) for h in holders}
    n_parts = {}
    for (rnd, name), vs in by_round_holder.items():
        n = int(vs[0]["part"].split("/")[1])
        assert n >= 2, f"{name} should need more than one visit per round with a {buffer_bytes}-byte buffer"
        assert [v["part"] for v in vs] == [f"{i}/{n}" for i in range(1, n + 1)], (rnd, name)
        assert n_parts.setdefault(name, n) == n  # the same split every round
    assert n_parts["alice"] > n_parts["bob"]  # more data, more parts
    assert [v["round"] for v in visits] == sorted(v["round"] for v in visits)  # rounds do not interleave
    assert [v["holder"] for v in visits[:4]] == ["alice", "bob", "alice", "bob"]

    # what each visit provisioned: no more than the buffer; the device confirmed exactly its window
    for v in visits:
        assert 0 < v["bytes"] <= buffer_bytes
        (given,) = handoffs[v["epoch"]]  # one key per visit here (the key budget is not reached)
        name, (train_start, train_len), (val_start, val_len), skip, length = given
        assert name == v["holder"] and skip == 0
        assert v["bytes"] == length == train_len + val_len

    # per holder and round, the training slices tile the holder's training data exactly once, in order,
    # and the held-out slice is the same every visit: the bytes provisioned sum to train_bytes + N x held-out
    for (rnd, name), vs in by_round_holder.items():
        slices = [handoffs[v["epoch"]][0] for v in vs]
        trains = [s[1] for s in slices]
        vals = {s[2] for s in slices}
        assert trains[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(trains, trains[1:], strict=False)), trains
        assert sum(n for _, n in trains) == holders[name]["train_bytes"], (rnd, name, trains)
        (val,) = vals
        assert val[0] + val[1] <= holders[name]["val_bytes"] and val[1] > 0
        assert sum(v["bytes"] for v in vs) == holders[name]["train_bytes"] + len(vs) * val[1]

    # the ledger tells the same story: one completed visit per part, with its part id and byte count
    rows = read_rows(out / "ledger.db")
    completed = [r for r in rows if r.kind == "visit-completed"]
    assert [r.detail["visit"] for r in completed] == [v["visit"] for v in visits]
    for r, v in zip(completed, visits, strict=True):
        part = int(v["part"].split("/")[0]) - 1
        assert r.detail["part"] == f"{v['holder']}/r{v['round']}/p{part}"
        assert (r.holder, r.epoch, r.nbytes) == (v["holder"], v["epoch"], v["bytes"])
    provisioned: dict[tuple[int, str], int] = defaultdict(int)
    for r in rows:
        if r.kind == "phase" and r.phase == "PROVISION":
            provisioned[(next(v["round"] for v in visits if v["visit"] == r.detail["visit"]), r.holder)] += r.nbytes
    assert provisioned == {k: sum(v["bytes"] for v in vs) for k, vs in by_round_holder.items()}
    assert report["provisioning"]["bytes"] == sum(v["bytes"] for v in visits)
    assert report["training"]["steps"] == len(visits) * settings.steps_per_visit
