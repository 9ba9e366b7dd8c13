"""``grant_at_completion`` end to end (task complete14): a real run over the embedded SSH server on 127.0.0.1, real
agents, a real device service. From each holder's second visit on the window's request carries its HANDOFF; the
device answers it once the window is complete, with the window closed in the answer, so RETURN sends no close request
for it; the holder's DONE is still read (its own durations reach the report); the ledger verifies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import small_settings, started

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.deviceclient.onloop import Completion, LoopCaller
from gputravel.core.ledger import read_rows, verify_ledger
from gputravel.core.protocol.deviceanswers import WindowClosed

pytestmark = [pytest.mark.usefixtures("no_leaked_processes"), pytest.mark.process]


async def test_a_relayed_windows_request_is_answered_at_completion_over_ssh(
        data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[Any] = []
    held = LoopCaller.handoff_until_complete

    async def recording(self: LoopCaller, **kw: Any) -> Completion:
        got = await held(self, **kw)
        answers.append(got[1])
        return got

    closes: list[int] = []
    close = DeviceClient.close_window

    def close_window(self: DeviceClient, *, epoch: int) -> Any:
        closes.append(epoch)
        return close(self, epoch=epoch)

    monkeypatch.setattr(LoopCaller, "handoff_until_complete", recording)
    monkeypatch.setattr(DeviceClient, "close_window", close_window)
    out = tmp_path / "run"
    settings = small_settings(data_root, out, rounds=2, transport="ssh", attest_prefetch=True,
                              handoff_with_window=True, grant_at_completion=True)
    async with started(settings) as engine:
        report = (await engine.run()).to_json()
    visits = report["visits"]
    assert len(visits) == 4 and all(v["outcome"] == "done" for v in visits)
    assert [v["handoff_relayed"] for v in visits] == [False, False, True, True]
    # the second visits' windows: answered once complete, closed in the answer, never asked to close
    assert len(answers) == 2 and all(isinstance(a, WindowClosed) and a.complete for a in answers)
    assert [a.epoch for a in answers] == [v["epoch"] for v in visits[2:]]
    assert not set(closes) & {v["epoch"] for v in visits[2:]}
    assert {v["epoch"] for v in visits[:2]} <= set(closes)  # the first visits close at RETURN, as before
    for v in visits[2:]:
        fixed = v["handoff_fixed_ms"]
        assert fixed["done_agent"] == 0.0  # the hand-off ended at the device's answer, not on the agent's DONE
        assert fixed["admission_agent"] > 0.0  # the DONE was read after all: the agent's own durations are kept
        assert v["bytes"] > 0
    rows = read_rows(out / "ledger.db")
    verify_ledger(out / "ledger.db")
    returns = [r for r in rows if r.kind == "phase" and r.phase == "RETURN"]
    assert [(r.epoch, r.outcome) for r in returns] == [(v["epoch"], "ok") for v in visits]
