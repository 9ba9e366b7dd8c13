"""Nonce exhaustion and epoch overflow are handled by rotating, never by reusing a nonce.

The limits are set low so a short run meets them many times; the trained model must equal the
unconstrained run's bit for bit, and every key use must stay inside its budget.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import HolderData, small_settings

from gputravel.console.entries import ENTRIES
from gputravel.core import api
from gputravel.core.ledger import read_rows, verify_ledger

WORDS = "seven wise owls sing softly over the quiet town while a lazy dog sleeps".split()


@pytest.fixture(scope="module")
def data(holder_data: HolderData) -> Path:
    return holder_data({"alice": 10, "bob": 11}, WORDS, 15_000, name="limits", newline=False)


async def run(data: Path, out: Path, *, nonce_budget: int | None = None, **kw: Any) -> dict[str, Any]:
    settings = small_settings(data, out, **kw)
    engine = await asyncio.to_thread(api.build_engine, settings, entries=ENTRIES)
    if nonce_budget:
        engine.device.client.nonce_budget = nonce_budget
    try:
        return (await engine.run()).to_json()
    finally:
        engine.device.client.close()
        engine.device.handle.stop()


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return asyncio.run(run(data, tmp_path_factory.mktemp("ref") / "run"))


async def test_control_channel_rotates_before_its_nonce_budget_runs_out(data: Path, tmp_path: Path,
                                                                       reference: dict[str, Any]) -> None:
    report = await run(data, tmp_path / "run", nonce_budget=4)
    assert report["control_rotations"] > len(report["visits"])  # beyond the one rotation per visit
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]
    assert all(v["outcome"] == "done" for v in report["visits"])


async def test_a_window_beyond_one_keys_chunk_budget_is_split_across_epochs(data: Path, tmp_path: Path,
                                                                             reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    report = await run(data, out, key_chunk_budget=2)
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]
    rows = list(read_rows(out / "ledger.db"))
    extra_keys = [r for r in rows if r.kind == "key-handed-over"]
    assert extra_keys, "no window was split"
    fps = [r.key_fp for r in rows if r.kind == "key-handed-over"] + [v["key_fingerprint"] for v in report["visits"]]
    assert len(fps) == len(set(fps))  # every sub-window had its own key
    epochs = [r.epoch for r in extra_keys] + [v["epoch"] for v in report["visits"]]
    assert len(epochs) == len(set(epochs))


async def test_epoch_limit_opens_a_fresh_attested_session(data: Path, tmp_path: Path,
                                                         reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    report = await run(data, out, key_chunk_budget=3, epoch_limit=1)
    assert report["session_rekeys"] >= 2
    assert report["training"]["model_digest"] == reference["training"]["model_digest"]
    rekeys = [r for r in read_rows(out / "ledger.db") if r.kind == "session-rekeyed"]
    assert len(rekeys) == report["session_rekeys"]
    assert all(r.detail["old_session_fp"] != r.detail["new_session_fp"] for r in rekeys)
    assert verify_ledger(out / "ledger.db").ok
