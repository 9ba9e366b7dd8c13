"""The next holder attests while a visit trains (issue 34 item 2): its ATTEST goes out during the TRAIN before its
visit, over the very key its window then gets; the hand-off takes that verdict and sends only the wrapped key. Off
(``attest_prefetch=False``), every hand-off attests in line. Real agents, a real device service, SIM evidence.

And the hand-off's relay: from a holder's second visit on, the device writes its HANDOFF on the agent's parked data
connection too (``handoff_relayed``); where the device cannot (here: every relay refused), the HANDOFF over the
holder link alone carries the visit, as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import small_settings, started

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.deviceclient.onloop import LoopCaller
from gputravel.core.errors import DeviceError
from gputravel.core.ledger import read_rows
from gputravel.core.protocol import FrameType
from gputravel.core.protocol.holderattest import CvmCheck, GpuCheck, Verdict
from gputravel.core.travel import framed_link
from gputravel.core.travel.local_link import LocalHolderLink

pytestmark = [pytest.mark.usefixtures("no_leaked_processes"), pytest.mark.process]


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, FrameType, dict[str, Any]]]:
    """Every frame the orchestrator sends to any agent: (holder, type, header)."""
    sent: list[tuple[str, FrameType, dict[str, Any]]] = []
    original = framed_link.FramedSession._send

    def recording(self: Any, ftype: FrameType, header: dict[str, Any], payload: bytes = b"") -> None:
        sent.append((self.name, ftype, dict(header)))
        original(self, ftype, header, payload)

    monkeypatch.setattr(framed_link.FramedSession, "_send", recording)
    return sent


@pytest.mark.parametrize("prefetch", [True, False])
async def test_the_next_holder_attests_during_training_over_its_own_key(
        prefetch: bool, data_root: Path, tmp_path: Path, tap: list[tuple[str, FrameType, dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(With ``prefetch`` off, every relay also fails at the device: the holder link's copy is the fallback.)"""
    relayed = prefetch
    if not relayed:
        def refused(self: DeviceClient, **_kw: Any) -> bool:
            raise DeviceError("the parked data connection is gone")

        monkeypatch.setattr(DeviceClient, "relay", refused)
    out = tmp_path / "run"
    settings = small_settings(data_root, out, rounds=2, transport="local", attest_prefetch=prefetch, handoff_relay=True)
    async with started(settings) as engine:
        report = (await engine.run()).to_json()
    visits = report["visits"]
    assert len(visits) == 4 and all(v["outcome"] == "done" for v in visits)
    # every visit had its verdict fetched before its hand-off (the first during its own ATTEST phase, the others
    # as the visit before trained), or none did, when off
    assert [v["attest_prefetched"] for v in visits] == [prefetch] * 4
    # each holder's first visit has no parked data connection yet; its second is relayed (unless the relay fails)
    assert [v["handoff_relayed"] for v in visits] == [False, False, relayed, relayed]
    frames = [(holder, t, h) for holder, t, h in tap if t in (FrameType.ATTEST, FrameType.HANDOFF)]
    # one ATTEST per hand-off, each before its HANDOFF, for the epoch and key that HANDOFF then carries
    attests = [(holder, h) for holder, t, h in frames if t is FrameType.ATTEST]
    handoffs = [(holder, h) for holder, t, h in frames if t is FrameType.HANDOFF]
    assert len(attests) == len(handoffs) == 4
    for (a_holder, a), (h_holder, h), v in zip(attests, handoffs, visits, strict=True):
        assert a_holder == h_holder == v["holder"]
        assert ("relay" in h) is (v["visit"] >= 2)  # the copy over the link of a relayed (or tried) HANDOFF
        assert "key" not in h and h["wrapped_key"]
        assert a["epoch"] == h["epoch"] == v["epoch"] and a["key_fp"] == h["key_fp"] == v["key_fingerprint"]
    order = [(holder, t) for holder, t, _ in frames]
    if prefetch:  # the next holder's ATTEST goes out before this visit's... nothing: it trains meanwhile
        assert order[:3] == [("alice", FrameType.ATTEST), ("alice", FrameType.HANDOFF), ("bob", FrameType.ATTEST)]
    else:
        assert order == [(v["holder"], t) for v in visits for t in (FrameType.ATTEST, FrameType.HANDOFF)]
    # the ledger holds each verdict once, in the visit it was for
    rows = [r for r in read_rows(out / "ledger.db") if r.kind == "holder-attestation"]
    assert [(r.holder, r.epoch, r.outcome) for r in rows] == [(v["holder"], v["epoch"], "ok") for v in visits]
    for v in visits:
        assert v["holder_attestation"]["gpu"]["ok"] is True
        stages = v["handoff_fixed_ms"]
        assert stages["total"] > 0 and all(x >= 0 for x in stages.values())
        if v["attest_prefetched"]:  # the evidence was built before the hand-off's clock started (at most the rest
            assert stages["attest"] == 0  # of the holder's check is waited for: its ``verdict`` stage)
        else:
            assert stages["attest"] > 0 and stages["verdict"] > 0


async def test_a_prefetch_no_hand_off_took_does_not_block_the_next(tmp_path: Path) -> None:
    """A visit that failed before its hand-off (the device died as the window opened) leaves its prefetched verdict
    behind, for a key that will never be granted: the next prefetch replaces it instead of being skipped."""
    link = LocalHolderLink("bob", tmp_path, agent=["unused"])  # never started: its state alone is tested

    async def fetched() -> None:
        return None

    stale = asyncio.get_running_loop().create_task(fetched())
    await stale
    link.session._prefetch = stale
    link.session._prefetched = (7, "stale-fp", Verdict(epoch=7, ok=True, cvm=CvmCheck(ok=True), gpu=GpuCheck(ok=True), ms=0.0,
                                                             next_nonce="00" * 32))
    link.session.prefetch_attestation(epoch=9, key_fp="new-fp")  # no attestor here: nothing new starts, nothing stale stays
    assert link.session._prefetch is None and link.session._prefetched is None


@pytest.mark.parametrize("delivered", [True, False])
async def test_a_visits_first_handoff_goes_with_its_window_request_and_the_link_copy_is_the_fallback(
        delivered: bool, data_root: Path, tmp_path: Path, tap: list[tuple[str, FrameType, dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``handoff_with_window``: from a holder's second visit on (its data connection parked, its verdict fetched
    ahead for the very epoch and key) the HANDOFF, wrapped before the window opened, goes with the window's request
    and the device writes it on the parked connection; no ``Op.RELAY`` is sent. The same HANDOFF (its ``relay`` id)
    goes over the holder link too. Where the device does not write it (``delivered`` False: here the request's relay
    is stripped on its way, as a dead connection would answer), that copy carries the visit. Each HANDOFF's
    ``ledger_head`` (the head before the window's request) is a row of the run's ledger, as a witness needs."""
    relays: list[str] = []

    def no_relay(self: DeviceClient, *, holder: str, **_kw: Any) -> bool:
        relays.append(holder)
        return False

    monkeypatch.setattr(DeviceClient, "relay", no_relay)
    requests: list[bool] = []
    original = LoopCaller.handoff  # the window's key is asked from the loop (core/deviceclient/onloop.py)

    async def handoff(self: LoopCaller, **kw: Any) -> Any:
        requests.append(kw.get("relay") is not None)
        if not delivered:
            kw.pop("relay", None)
        return await original(self, **kw)

    monkeypatch.setattr(LoopCaller, "handoff", handoff)
    out = tmp_path / "run"
    settings = small_settings(data_root, out, rounds=2, transport="local", attest_prefetch=True,
                              handoff_with_window=True, grant_at_completion=False)  # the grant answered at once
    async with started(settings) as engine:
        report = (await engine.run()).to_json()
    visits = report["visits"]
    assert len(visits) == 4 and all(v["outcome"] == "done" for v in visits)
    assert requests == [False, False, True, True]  # the second visits' windows carried their HANDOFF
    assert [v["handoff_relayed"] for v in visits] == [False, False, delivered, delivered]
    assert relays == []  # never a separate relay round trip
    handoffs = [h for _, t, h in tap if t is FrameType.HANDOFF]
    assert [("relay" in h) for h in handoffs] == [False, False, True, True]  # the link's copy of the same HANDOFF
    rows = read_rows(out / "ledger.db")
    hashes = {r.seq: r.hash for r in rows}
    for h, v in zip(handoffs, visits, strict=True):
        assert "key" not in h and h["key_fp"] == v["key_fingerprint"] and h["epoch"] == v["epoch"]
        seq, digest = h["ledger_head"].split(":")
        assert hashes[int(seq)] == digest  # a head of this chain: the holder's witness and receipts check it
    verdicts = [r for r in rows if r.kind == "holder-attestation"]
    assert [(r.holder, r.epoch, r.outcome) for r in verdicts] == [(v["holder"], v["epoch"], "ok") for v in visits]
