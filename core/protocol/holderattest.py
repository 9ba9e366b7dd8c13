"""The holder link's attestation messages (issue 22 item 5, issue 30): ATTEST, what a holder verifies before it
takes a hand-off's key, and VERDICT, its answer with what it checked against. Re-exported by ``holderlink``.

Both are declared on the wire base (``core/protocol/wire.py``, ``FrameMessage``): a malformed one is a
``FrameError`` (code ``frame``) naming the message and the field. ATTEST's header is :class:`AttestHead` (its
evidence rides in the payload, the four sizes in the header); VERDICT nests the CVM's and the GPU's checks
(:class:`CvmCheck`, :class:`GpuCheck`) and what the agent checked against (:class:`VerdictPolicy`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.frames import FrameType
from gputravel.core.protocol.wire import (
    MAX_FLOAT,
    Flag,
    Float,
    FrameMessage,
    Hex,
    Int,
    ListOf,
    MapOf,
    Nested,
    Opt,
    Str,
    TupleOf,
    bounds,
)

__all__ = ["ATTEST_PARTS", "POLICY_SOURCES", "Attest", "AttestHead", "CvmCheck", "GpuCheck", "Verdict",
           "VerdictPolicy"]

#: the four parts of an ATTEST's payload, in order
ATTEST_PARTS = ("quote", "collateral", "gpu_report", "gpu_chain")
#: who chose what an attesting agent checks: the holder itself (``holder serve``) or the orchestrator (``--attest-policy``)
POLICY_SOURCES = ("holder", "orchestrator")
_MAX_EVIDENCE = 1 << 20
_SIZE = Int(0, _MAX_EVIDENCE)


@dataclass(frozen=True, slots=True)
class AttestHead(FrameMessage):
    """ATTEST's header: the run, the epoch, the key's fingerprint, the CVM's key-exchange key and the sizes of
    the four evidence parts that follow in the payload."""

    run_id: str = field(metadata=bounds(Str(128), wire="run"))
    epoch: int = field(metadata=bounds(Int()))
    key_fp: str = field(metadata=bounds(Str(64)))
    link_pub: str = field(metadata=bounds(Hex(64)))
    sizes: tuple[int, ...] = field(metadata=bounds(TupleOf((_SIZE,) * len(ATTEST_PARTS))))


@dataclass(frozen=True, slots=True)
class Attest:
    """ATTEST: what a holder verifies before it takes a hand-off's key. The header (:class:`AttestHead`) names
    the run, the epoch, the key's fingerprint and the CVM's key-exchange key (``link_pub``, hex); the payload
    carries the TDX quote, its collateral (JSON), the GPU's SPDM report and its PEM chain."""

    FRAME: ClassVar[FrameType] = FrameType.ATTEST
    run_id: str
    epoch: int
    key_fp: str
    link_pub: str
    quote: bytes
    collateral: bytes
    gpu_report: bytes
    gpu_chain: bytes

    def parts(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The evidence in ``ATTEST_PARTS`` order."""
        return self.quote, self.collateral, self.gpu_report, self.gpu_chain

    def to_wire(self) -> dict[str, Any]:
        return AttestHead(self.run_id, self.epoch, self.key_fp, self.link_pub,
                          tuple(len(p) for p in self.parts())).to_wire()

    def payload(self) -> bytes:
        return b"".join(self.parts())

    @classmethod
    def from_frame(cls, h: Any, payload: bytes | bytearray | memoryview) -> Attest:
        head = AttestHead.from_wire(h, where="Attest")
        if sum(head.sizes) != len(payload):
            raise FrameError(f"Attest sizes {list(head.sizes)} do not describe its {len(payload)}-byte payload")
        raw, parts, at = bytes(payload), [], 0
        for n in head.sizes:
            parts.append(raw[at:at + n])
            at += n
        quote, collateral, gpu_report, gpu_chain = parts
        return cls(head.run_id, head.epoch, head.key_fp, head.link_pub, quote, collateral, gpu_report, gpu_chain)


@dataclass(frozen=True, slots=True)
class CvmCheck(FrameMessage):
    """The CVM's part of a verdict (``HolderVerifier.check_cvm``)."""

    ok: bool = field(default=False, metadata=bounds(Flag()))
    tcb_status: str | None = field(default=None, metadata=bounds(Opt(Str(64))))
    mr_td: str | None = field(default=None, metadata=bounds(Opt(Hex(96))))
    failed: str | None = field(default=None, metadata=bounds(Opt(Str(128))))


@dataclass(frozen=True, slots=True)
class GpuCheck(FrameMessage):
    """The GPU's part of a verdict (``HolderVerifier.check_gpu``): the SPDM nonce and the claims that failed."""

    ok: bool = field(default=False, metadata=bounds(Flag()))
    nonce: str | None = field(default=None, metadata=bounds(Opt(Hex(64))))
    claims_failed: list[str] = field(default_factory=list, metadata=bounds(ListOf(Str(127), max_len=64)))


@dataclass(frozen=True, slots=True)
class VerdictPolicy(FrameMessage):
    """What the agent checked against, as it states it (issue 30)."""

    source: str | None = field(default=None, metadata=bounds(Opt(Str(16, choices=frozenset(POLICY_SOURCES)))))
    sha256: str | None = field(default=None, metadata=bounds(Opt(Hex(64))))
    roots: dict[str, str] = field(default_factory=dict, metadata=bounds(MapOf(Str(127), max_len=8, key_len=31)))
    mr_td_policy: str | None = field(default=None,
                                     metadata=bounds(Opt(Str(16, choices=frozenset({"pinned", "any"})))))


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict(FrameMessage):
    """VERDICT: the holder's own verdict on an ATTEST (``report()`` is the run report's
    ``visits[].holder_attestation``), with its fresh nonce for the next hand-off (``next_nonce``). A verdict
    read from the wire is ok only if its CVM and GPU parts are (:meth:`validated`)."""

    FRAME: ClassVar[FrameType] = FrameType.VERDICT
    epoch: int = field(metadata=bounds(Int()))
    ok: bool = field(metadata=bounds(Flag()))
    cvm: CvmCheck = field(metadata=bounds(Nested(CvmCheck)))
    gpu: GpuCheck = field(metadata=bounds(Nested(GpuCheck)))
    ms: float = field(default=0.0, metadata=bounds(Float(0.0, MAX_FLOAT)))
    next_nonce: str = field(metadata=bounds(Hex(64)))
    #: what the agent checked against; None for an agent that predates it
    policy: VerdictPolicy | None = field(default=None, metadata=bounds(Opt(Nested(VerdictPolicy)), sparse=True))
    #: SHA-256 (hex) of the evidence the verdict is on: {"quote", "collateral", "gpu_report", "gpu_chain"}
    evidence: dict[str, str] = field(default_factory=dict,
                                     metadata=bounds(MapOf(Hex(64), max_len=len(ATTEST_PARTS), key_len=16),
                                                     sparse=True))

    def validated(self) -> Verdict:
        ok = self.ok and self.cvm.ok and self.gpu.ok
        return self if ok == self.ok else dataclasses.replace(self, ok=ok)

    @property
    def failed_claim(self) -> str | None:
        """The first claim that failed (CVM first), or None."""
        if not self.cvm.ok:
            return self.cvm.failed or "cvm"
        if not self.gpu.ok:
            return (self.gpu.claims_failed or ["gpu"])[0]
        return None

    def report(self) -> dict[str, Any]:
        """``visits[].holder_attestation`` and the ledger row's detail: the verdict, what it was checked against
        (``policy_source``, ``policy_sha256``, ``roots``, ``mr_td_policy``) and on which evidence."""
        claims_failed = list(self.gpu.claims_failed)
        measres = None if not self.gpu.nonce else ("fail" if "measres" in claims_failed or not self.gpu.ok
                                                   else "success")
        policy = self.policy or VerdictPolicy()
        return {"cvm": {"ok": self.cvm.ok, "tcb_status": self.cvm.tcb_status, "mr_td": self.cvm.mr_td},
                "gpu": {"ok": self.gpu.ok, "nonce": self.gpu.nonce, "claims_failed": claims_failed,
                        "measres": measres},
                "ms": self.ms, "failed_claim": self.failed_claim,
                "policy_source": policy.source, "policy_sha256": policy.sha256, "roots": dict(policy.roots),
                "mr_td_policy": policy.mr_td_policy, "evidence_sha256": dict(self.evidence)}
