"""Holders attest an SEV-SNP orchestrator CVM like a TDX one (issue 31 item 2): raw SNP reports and Azure's HCL
report + vTPM quote from the platform's SIM chip (``core.evidence.sim_snp``, ARK/ASK pinned by the SIM policy's
``[amd-snp]``), bound to the CVM's X25519 key and the run id; each injected fault refused by name in each kind;
and real runs (agents, device service, key wrapping) with ``--cvm-kind snp`` / ``azure-snp``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gputravel.agents.holder.attest import HolderAttestation
from gputravel.console.cli import main as cli
from gputravel.core.device.spdm import SpdmResponder
from gputravel.core.evidence import sim_store
from gputravel.core.evidence.cvm_snp import cvm_kind
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.holderlink import Attest, Handoff, ProvisioningKey, Verdict
from gputravel.core.travel.holder_attest import CVM_KINDS, HolderAttestor, SimCvm, holder_args

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

#: the claim each CVM injection is refused on, per kind
REFUSED_ON = {("snp", "cvm-debug"): "guest-not-debug", ("snp", "cvm-report-data"): "report-data-binding",
              ("azure-snp", "cvm-debug"): "guest-not-debug",
              ("azure-snp", "cvm-report-data"): "report-data-binding",
              ("tdx", "cvm-debug"): "td-not-debug", ("tdx", "cvm-report-data"): "report-data-binding"}


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


def _handoff() -> Handoff:
    key = ProvisioningKey(bytes(range(32)), b"\x01\x02\x03\x04", 7, int(Direction.HOLDER_TO_DEVICE))
    return Handoff(epoch=7, session_id="ab" * 16, key=key, window_offset=0, chunk_size=4096, train=(0, 8192),
                   val=(0, 4096))


async def _verdict(platform: Path, kind: str, inject: str | None = None) -> tuple[Verdict, Attest]:
    device = _Device(platform)
    attestor = HolderAttestor(run_id="run-snp", cvm=SimCvm.load(platform, kind),
                              client=lambda: device, inject=inject)  # type: ignore[arg-type,return-value]
    holder = HolderAttestation.load(*holder_args(platform))
    msg = await attestor.attest(_handoff(), holder.nonce)
    wire = Attest.from_frame(msg.to_wire(), msg.payload())  # as the agent reads it
    return Verdict.from_wire(holder.verify(wire).to_wire()), wire


@pytest.mark.parametrize("kind", CVM_KINDS)
async def test_honest_cvm_evidence_of_each_kind_verifies(platform: Path, kind: str) -> None:
    verdict, wire = await _verdict(platform, kind)
    assert verdict.ok, verdict.failed_claim
    assert cvm_kind(wire.collateral) == kind
    if kind != "tdx":
        assert str(verdict.cvm.tcb_status).startswith("SNP milan bl3 tee0 snp8 uc115")
        assert len(wire.quote) == (1184 if kind == "snp" else 2048)


@pytest.mark.parametrize(("kind", "inject"), sorted(REFUSED_ON))
async def test_each_cvm_fault_is_refused_by_name_in_each_kind(platform: Path, kind: str, inject: str) -> None:
    verdict, _ = await _verdict(platform, kind, inject)
    assert not verdict.ok and verdict.failed_claim == REFUSED_ON[(kind, inject)]


async def test_the_gpu_faults_are_refused_with_an_snp_cvm_too(platform: Path) -> None:
    verdict, _ = await _verdict(platform, "snp", "gpu-nonce")
    assert not verdict.ok and verdict.failed_claim == "x-nvidia-gpu-attestation-report-nonce-match"


async def test_an_snp_report_for_another_run_is_refused(platform: Path) -> None:
    device = _Device(platform)
    attestor = HolderAttestor(run_id="run-a", cvm=SimCvm.load(platform, "snp"), client=lambda: device)  # type: ignore[arg-type,return-value]
    holder = HolderAttestation.load(*holder_args(platform))
    msg = await attestor.attest(_handoff(), holder.nonce)
    other = Attest(run_id="run-b", epoch=msg.epoch, key_fp=msg.key_fp, link_pub=msg.link_pub, quote=msg.quote,
                   collateral=msg.collateral, gpu_report=msg.gpu_report, gpu_chain=msg.gpu_chain)
    assert holder.verify(other).failed_claim == "report-data-binding"


def test_an_unknown_cvm_kind_is_refused(platform: Path) -> None:
    with pytest.raises(ValueError, match="unknown CVM kind"):
        SimCvm.load(platform, "sev")


# --- real runs ----------------------------------------------------------------------------------------------
def _run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["gputravel", *args])
    with pytest.raises(SystemExit) as info:
        cli.main()
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


def _small(data: Path, out: Path, kind: str) -> list[str]:
    return ["run", "--data", str(data), "--holders", "2", "--rounds", "1", "--steps-per-visit", "2",
            "--batch-size", "4", "--seq-len", "32", "--chunk-kib", "16", "--buffer-mib", "0.25", "--out", str(out),
            "--json", "--no-record", "--transport", "local", "--cvm-kind", kind]


@pytest.mark.process
@pytest.mark.parametrize("kind", ["snp", "azure-snp"])
def test_a_run_with_a_sim_snp_cvm_has_both_holder_verdicts_on_every_visit(
        kind: str, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, err = _run_cli(monkeypatch, capsys, *_small(data_root, tmp_path / "run", kind))
    assert code == 0, err
    visits = json.loads(stdout)["visits"]
    assert visits and all(v["outcome"] == "done" for v in visits)
    for v in visits:
        att = v["holder_attestation"]
        assert att["cvm"]["ok"] is True and str(att["cvm"]["tcb_status"]).startswith("SNP milan")
        assert att["gpu"]["ok"] is True and att["gpu"]["claims_failed"] == []


@pytest.mark.process
def test_a_run_with_an_snp_cvm_and_an_injected_debug_guest_releases_no_key(
        data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, err = _run_cli(monkeypatch, capsys, *_small(data_root, tmp_path / "run", "snp"),
                                 "--visit-attempts", "1", "--inject", "cvm-debug")
    assert code == 3 and "guest-not-debug" in err
    for v in json.loads(stdout)["visits"]:
        assert v["outcome"] == "failed" and v["bytes"] == 0
        assert v["holder_attestation"]["failed_claim"] == "guest-not-debug"
