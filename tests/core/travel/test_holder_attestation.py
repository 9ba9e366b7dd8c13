"""Holders attest the orchestrator's CVM and the GPU themselves before they take a key (issue 22 item 5).

The parts are real: SIM TDX quotes verified by dcap-qvl under the SIM root, SIM SPDM reports signed with ECDSA
P-384 under the SIM chain, X25519 + AES-GCM key wrapping, real agents, a real device service, real runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gputravel.agents.holder.attest import HolderAttestation
from gputravel.console.cli import main as cli
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.errors import FrameError, GpuTravelError
from gputravel.core.evidence import sim_store
from gputravel.core.ledger import read_rows
from gputravel.core.protocol import FrameType
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.holderlink import Attest, Handoff, Hello, ProvisioningKey, Verdict
from gputravel.core.protocol.keywrap import LinkKey, cvm_report_data, spdm_nonce
from gputravel.core.travel import framed_link
from gputravel.core.travel.holder_attest import INJECTIONS, HolderAttestor, SimCvm, holder_args

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

#: the claim each injection must be refused on
REFUSED_ON = {"cvm-debug": "td-not-debug", "cvm-report-data": "report-data-binding", "gpu-measurement": "measres",
              "gpu-nonce": "x-nvidia-gpu-attestation-report-nonce-match"}


# --- the checks, without a run ----------------------------------------------------------------------------
class _Device:
    """The device's real SPDM responder behind the one call the attestor makes (no control channel)."""

    def __init__(self, state_dir: Path) -> None:
        self.responder = SpdmResponder(state_dir)

    def call(self, op: str, **args: Any) -> tuple[dict[str, Any], bytes]:
        assert op == "gpu_evidence"
        return self.responder.answer(**args), b""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("platform")
    sim_store.load_or_create(folder)
    return folder


def _key(epoch: int = 7) -> ProvisioningKey:
    return ProvisioningKey(bytes(range(32)), b"\x01\x02\x03\x04", epoch, int(Direction.HOLDER_TO_DEVICE))


def _handoff(key: ProvisioningKey | None = None) -> Handoff:
    key = key or _key()
    return Handoff(epoch=key.epoch, session_id="ab" * 16, key=key, window_offset=0, chunk_size=4096,
                   train=(0, 8192), val=(0, 4096))


def _pair(platform: Path, inject: str | None = None) -> tuple[HolderAttestor, HolderAttestation]:
    device = _Device(platform)
    attestor = HolderAttestor(run_id="run-1", cvm=SimCvm.load(platform), client=lambda: device,  # type: ignore[arg-type,return-value]
                              inject=inject)
    return attestor, HolderAttestation.load(*holder_args(platform))


async def _round(attestor: HolderAttestor, holder: HolderAttestation, handoff: Handoff) -> Verdict:
    msg = await attestor.attest(handoff, holder.nonce)
    wire = Attest.from_frame(msg.to_wire(), msg.payload())  # as the agent reads it
    return Verdict.from_wire(holder.verify(wire).to_wire())


async def test_honest_evidence_verifies_and_only_the_attested_agent_unwraps_the_key(platform: Path) -> None:
    attestor, holder = _pair(platform)
    handoff = _handoff()
    first_nonce = holder.nonce
    verdict = await _round(attestor, holder, handoff)
    assert verdict.ok and verdict.failed_claim is None
    assert verdict.cvm.tcb_status == "UpToDate"
    assert verdict.gpu.nonce == spdm_nonce(first_nonce, handoff.key.fingerprint, handoff.epoch).hex()  # type: ignore[union-attr]
    assert verdict.next_nonce != first_nonce.hex()  # the holder's nonce is fresh for every hand-off
    sent = attestor.seal_key(handoff, holder.link_key.public)
    wire = sent.to_wire()
    assert "key" not in wire and handoff.key.key.hex() not in json.dumps(wire)  # type: ignore[union-attr]
    got = holder.accept(Handoff.from_wire(wire))
    assert got.key == handoff.key
    # the same wrapped key for another agent (its own key-exchange key) does not open
    other = HolderAttestation.load(*holder_args(platform))
    other.attested = (handoff.epoch, handoff.key.fingerprint, "run-1", attestor.link_key.public)  # type: ignore[union-attr]
    with pytest.raises(GpuTravelError, match="does not open"):
        other.accept(Handoff.from_wire(wire))


@pytest.mark.parametrize("inject", INJECTIONS)
async def test_each_injected_fault_is_refused_by_name(platform: Path, inject: str) -> None:
    attestor, holder = _pair(platform, inject)
    verdict = await _round(attestor, holder, _handoff())
    assert not verdict.ok
    assert verdict.failed_claim == REFUSED_ON[inject]
    report = verdict.report()
    assert report["cvm"]["ok"] is inject.startswith("gpu")
    assert report["gpu"]["ok"] is inject.startswith("cvm")
    with pytest.raises(GpuTravelError, match="no attested evidence"):  # a failed verdict lets no key in
        holder.accept(Handoff.from_wire(attestor.seal_key(_handoff(), holder.link_key.public).to_wire()))


async def test_a_replayed_attest_fails_on_the_nonce(platform: Path) -> None:
    attestor, holder = _pair(platform)
    msg = await attestor.attest(_handoff(), holder.nonce)
    assert holder.verify(msg).ok
    replay = holder.verify(msg)  # the holder's nonce moved on: yesterday's evidence is refused
    assert replay.failed_claim == "x-nvidia-gpu-attestation-report-nonce-match"


async def test_an_attesting_agent_refuses_a_plain_key_another_key_or_epoch(platform: Path) -> None:
    attestor, holder = _pair(platform)
    with pytest.raises(GpuTravelError, match="no attested evidence"):
        holder.accept(_handoff())
    assert (await _round(attestor, holder, _handoff())).ok
    with pytest.raises(GpuTravelError, match="not the attested one"):
        holder.accept(_handoff())  # a plain key, even the attested one, is not taken
    assert (await _round(attestor, holder, _handoff())).ok
    with pytest.raises(GpuTravelError, match="not the attested one"):
        holder.accept(Handoff.from_wire(attestor.seal_key(_handoff(ProvisioningKey(
            bytes(32), b"\0" * 4, 7, int(Direction.HOLDER_TO_DEVICE))), holder.link_key.public).to_wire()))
    assert (await _round(attestor, holder, _handoff())).ok
    with pytest.raises(GpuTravelError, match="attested epoch 7"):
        holder.accept(_handoff(_key(8)))


def test_the_cvm_report_data_binds_the_key_exchange_and_the_run() -> None:
    pub = LinkKey().public
    assert len(cvm_report_data(pub, "r")) == 64
    assert cvm_report_data(pub, "r") != cvm_report_data(pub, "s") != cvm_report_data(LinkKey().public, "r")


def test_wire_forms_validate() -> None:
    hello = Hello(name="a", version="1", fmt="byte", train_bytes=1, val_bytes=1, files=1, agent_sha256="0" * 64,
                  nonce="11" * 32, link_pub="22" * 32)
    assert Hello.from_wire(hello.to_wire()) == hello
    with pytest.raises(FrameError, match="nonce"):
        Hello.from_wire({**hello.to_wire(), "nonce": "11"})
    msg = Attest("r", 1, "fp", "33" * 32, b"q", b"c", b"rep", b"chain")
    assert Attest.from_frame(msg.to_wire(), msg.payload()) == msg
    with pytest.raises(FrameError, match="sizes"):
        Attest.from_frame(msg.to_wire(), msg.payload() + b"x")
    bad = {"epoch": 1, "ok": True, "cvm": {"ok": True}, "gpu": {"ok": True, "claims_failed": "measres"},
           "next_nonce": "00" * 32}
    with pytest.raises(FrameError, match="claims_failed"):
        Verdict.from_wire(bad)
    # a verdict that says ok while a part failed is not ok
    lying = {**bad, "gpu": {"ok": False, "claims_failed": ["measres"]}}
    assert Verdict.from_wire(lying).ok is False


# --- runs ------------------------------------------------------------------------------------------------
# data_root: conftest.py (alice and bob)
def _run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["gputravel", *args])
    with pytest.raises(SystemExit) as info:
        cli.main()
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


def _small(data: Path, out: Path) -> list[str]:
    return ["run", "--data", str(data), "--holders", "2", "--rounds", "1", "--steps-per-visit", "2",
            "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out),
            "--json", "--no-record"]


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


def test_every_visit_of_a_default_shaped_run_carries_both_holder_verdicts(
        data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tap: list[tuple[str, FrameType, dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    code, stdout, _ = _run_cli(monkeypatch, capsys, *_small(data_root, out))  # the default transport (ssh)
    assert code == 0
    report = json.loads(stdout)
    visits = report["visits"]
    assert visits and all(v["outcome"] == "done" for v in visits)
    nonces = set()
    for v in visits:
        att = v["holder_attestation"]
        assert {k: att["cvm"][k] for k in ("ok", "tcb_status")} == {"ok": True, "tcb_status": "UpToDate"}
        assert len(att["cvm"]["mr_td"]) == 96  # the MRTD the holder accepted (issue 30)
        # the orchestrator chose what these agents check (the SIM platform's policy): said so, with its digest
        assert att["policy_source"] == "orchestrator" and len(att["policy_sha256"]) == 64
        assert att["mr_td_policy"] == "any" and set(att["roots"]) == {"gpu", "tdx"}
        assert att["gpu"]["measres"] == "success" and set(att["evidence_sha256"]) == {
            "quote", "collateral", "gpu_report", "gpu_chain"}
        assert att["gpu"]["ok"] is True and att["gpu"]["claims_failed"] == []
        assert att["ms"] >= 0
        nonces.add(att["gpu"]["nonce"])
    assert len(nonces) == len(visits)
    assert report["holder_refusals"] == []
    rows = [r for r in read_rows(out / "ledger.db") if r.kind == "holder-attestation"]
    assert [(r.holder, r.outcome) for r in rows] == [(v["holder"], "ok") for v in visits]
    handoffs = [h for _, t, h in tap if t is FrameType.HANDOFF]
    assert len(handoffs) == len(visits)
    assert all("key" not in h and h.get("wrapped_key") for h in handoffs)  # never a key in the clear


@pytest.mark.parametrize("inject", INJECTIONS)
def test_an_injected_fault_makes_every_holder_refuse_and_no_key_is_released(
        inject: str, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tap: list[tuple[str, FrameType, dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    code, stdout, err = _run_cli(monkeypatch, capsys, *_small(data_root, out), "--transport", "local",
                                 "--visit-attempts", "1", "--inject", inject)
    assert code == 3, err
    assert REFUSED_ON[inject] in err
    report = json.loads(stdout)
    assert {v["holder"] for v in report["visits"]} == {"alice", "bob"}
    for v in report["visits"]:
        assert v["outcome"] == "failed" and v["bytes"] == 0  # none of its data reached the device
        assert v["holder_attestation"]["failed_claim"] == REFUSED_ON[inject]
    assert {(r["holder"], r["claim"]) for r in report["holder_refusals"]} == {("alice", REFUSED_ON[inject]),
                                                                              ("bob", REFUSED_ON[inject])}
    # no HANDOFF (with a key, wrapped or not) went to any agent; each got its ATTEST
    assert {t for _, t, _ in tap} >= {FrameType.ATTEST}
    assert not [h for _, t, h in tap if t is FrameType.HANDOFF]
    rows = [r for r in read_rows(out / "ledger.db") if r.kind == "holder-attestation"]
    assert {(r.holder, r.outcome, r.detail["claim"]) for r in rows} == {("alice", "refused", REFUSED_ON[inject]),
                                                                         ("bob", "refused", REFUSED_ON[inject])}
