"""The orchestrator's side of the holders' own attestation (issue 22 item 5).

Before a hand-off's key goes to an attesting agent (its HELLO carried a nonce and a key-exchange key), its link
sends ATTEST: the orchestrator CVM's TDX quote with collateral (made once a run: the report data binds the
CVM's X25519 key-exchange key and the run id, ``keywrap.cvm_report_data``) and the GPU's SPDM report for this
hand-off, which the device signs over ``keywrap.spdm_nonce(holder nonce, key fingerprint, epoch)``. The agent
answers VERDICT; only an ok verdict lets the HANDOFF go, its key wrapped for that agent under the attested key
exchange. A refusal is ``HolderRefusedError`` (an ``AgentError``: the visit fails, no key byte left).

SIM: the CVM is the emulated platform's SIM TDX guest (``core.evidence.sim_tdx``), or with ``cvm_kind`` its SIM
SEV-SNP guest, raw or in Azure's form (``core.evidence.sim_snp``; identities in ``<platform>/vendor-formats/``), the GPU the device's SIM SPDM responder (``core/device/spdm.py``). ``inject``
(``gputravel run --inject``) makes the evidence wrong in one named way; every holder must refuse it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.errors import AgentError
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.devicelink import Op
from gputravel.core.protocol.holderlink import Attest, Handoff, Verdict
from gputravel.core.protocol.keys import KEY_LEN, DirectionKey
from gputravel.core.protocol.keywrap import (
    LinkKey,
    conventional_secret,
    cvm_report_data,
    spdm_nonce,
    wrap_key,
)

__all__ = ["CVM_KINDS", "INJECTIONS", "HolderAttestor", "HolderRefusedError", "SimCvm", "holder_args"]

INJECTIONS = ("cvm-debug", "cvm-report-data", "gpu-measurement", "gpu-nonce")
CVM_KINDS = ("tdx", "snp", "azure-snp")


class HolderRefusedError(AgentError):
    """A holder's own attestation refused the CVM or the GPU: it took no key."""

    def __init__(self, holder: str, verdict: Verdict) -> None:
        super().__init__(holder, f"holder attestation refused: {verdict.failed_claim} (no key released)")
        self.verdict = verdict


@dataclass(slots=True)
class SimCvm:
    """The orchestrator's CVM, SIM, of one kind (issue 31): ``tdx`` (TDX quotes from the platform's SIM TDX guest),
    ``snp`` (SEV-SNP reports from its SIM chip) or ``azure-snp`` (Azure's HCL report + a TPM quote by its SIM
    vTPM key). Each binds the report data it is given (``keywrap.cvm_report_data``)."""

    tdx: Any  # core.evidence.sim_tdx.SimTdx
    kind: str = "tdx"
    snp: Any = None  # core.evidence.sim_snp.SimAzureVm (its .chip for a raw SNP CVM)

    @classmethod
    def load(cls, platform_dir: Path, kind: str = "tdx") -> SimCvm:
        from gputravel.core.evidence import sim_store

        if kind not in CVM_KINDS:
            raise ValueError(f"unknown CVM kind {kind!r} (one of {', '.join(CVM_KINDS)})")
        tdx = sim_store.load_or_create(platform_dir)[1]
        return cls(tdx, kind, sim_store.load_or_create_snp(platform_dir) if kind != "tdx" else None)

    def evidence(self, report_data: bytes, *, debug: bool = False) -> tuple[bytes, bytes]:
        """(quote, collateral) issued now: for SNP kinds the report and ``cvm_snp.snp_collateral``."""
        if self.kind == "tdx":
            issued = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=5)
            return self.tdx.quote(report_data, debug=debug), self.tdx.collateral(issued=issued).encode()
        from cryptography.hazmat.primitives.serialization import Encoding

        from gputravel.core.evidence.cvm_snp import snp_collateral

        vcek = self.snp.chip.vcek.public_bytes(Encoding.PEM)
        if self.kind == "snp":
            return self.snp.chip.report(report_data, debug=debug), snp_collateral("snp", vcek)
        # Azure: the HCL report binds the vTPM key; the quote by that key carries the report data
        return self.snp.hcl_report(debug=debug), snp_collateral("azure-snp", vcek,
                                                                tpm_quote=self.snp.quote(report_data))


def holder_args(platform_dir: Path) -> tuple[Path, Path]:
    """What a local attesting agent pins on the SIM platform: the SIM evidence policy and the SIM GPU's golden
    measurements (both written by ``sim_store``; a real holder's operator writes its own). Absolute: an agent
    behind SSH runs in its user's home, not in the orchestrator's folder."""
    folder = Path(platform_dir).resolve() / "vendor-formats"
    return folder / "sim-evidence.toml", folder / "gpu.json"


class HolderAttestor:
    """One run's CVM identity (X25519 key, quote, collateral) and the per-hand-off GPU evidence."""

    def __init__(self, *, run_id: str, cvm: SimCvm, client: Callable[[], DeviceClient],
                 inject: str | None = None) -> None:
        if inject is not None and inject not in INJECTIONS:
            raise ValueError(f"unknown holder injection {inject!r}")
        self.run_id = run_id
        self.inject = inject
        self.client = client
        self.link_key = LinkKey()
        bound = os.urandom(32) if inject == "cvm-report-data" else self.link_key.public  # another key: unbound
        self.quote, self.collateral = cvm.evidence(cvm_report_data(bound, run_id), debug=inject == "cvm-debug")
        self._chain: bytes | None = None

    def _gpu(self, nonce: bytes) -> tuple[bytes, bytes]:
        """The GPU's SPDM report over ``nonce`` (and its chain, asked once a run)."""
        args: dict[str, Any] = {"nonce": nonce.hex(), "chain": self._chain is None}
        if self.inject == "gpu-measurement":
            args["tamper"] = "measurement"
        head, _ = self.client().call(Op.GPU_EVIDENCE, **args)
        if self._chain is None:
            self._chain = str(head["chain"]).encode()
        return bytes.fromhex(str(head["report"])), self._chain

    async def attest(self, handoff: Handoff, holder_nonce: bytes) -> Attest:
        """ATTEST for one hand-off to a holder whose current nonce is ``holder_nonce``."""
        fp = handoff.key.fingerprint if handoff.key is not None else ""
        return await self.attest_key(epoch=handoff.epoch, key_fp=fp, holder_nonce=holder_nonce)

    async def attest_key(self, *, epoch: int, key_fp: str, holder_nonce: bytes) -> Attest:
        """ATTEST for the hand-off of key ``key_fp`` in ``epoch`` (known before its window opens: the key is
        derived from the session, the epoch and the window, ``core.protocol.keys.provisioning_key``)."""
        fp = key_fp
        nonce = spdm_nonce(holder_nonce, fp, epoch)
        if self.inject == "gpu-nonce":  # evidence for another request (a replayed or misbound report)
            nonce = os.urandom(32)
        report, chain = await asyncio.to_thread(self._gpu, nonce)
        return Attest(self.run_id, epoch, fp, self.link_key.public.hex(), self.quote, self.collateral,
                      report, chain)

    def seal_key(self, handoff: Handoff, holder_pub: bytes) -> Handoff:
        """The hand-off as it goes to an attested holder: its key wrapped for it, never in the clear."""
        if handoff.key is None or handoff.conventional:
            return handoff
        key = handoff.key
        wrapped = wrap_key(self.link_key, holder_pub, self.run_id.encode(), key.key + key.prefix,
                           epoch=handoff.epoch, fingerprint=key.fingerprint)
        return replace(handoff, key=None, wrapped_key=wrapped, key_fp=key.fingerprint)

    def conventional_key(self, holder_pub: bytes, epoch: int) -> DirectionKey:
        """The key an attesting agent seals a conventional hand-off's data under, to this CVM (issue 30)."""
        secret = conventional_secret(self.link_key, holder_pub, self.run_id, epoch)
        return DirectionKey(secret[:KEY_LEN], secret[KEY_LEN:], epoch, int(Direction.HOLDER_TO_DEVICE))
