"""The holder link's attestation messages (issue 22 item 5, issue 30): ATTEST, what a holder verifies before it
takes a hand-off's key, and VERDICT, its answer with what it checked against. Re-exported by ``holderlink``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gputravel.core.protocol.errors import FrameError
from gputravel.core.protocol.frames import FrameType
from gputravel.core.protocol.holderfields import _MISSING, _flag, _get, _hex, _int, _source, _str

__all__ = ["Attest", "Verdict"]

_ATTEST_PARTS = ("quote", "collateral", "gpu_report", "gpu_chain")
_MAX_EVIDENCE = 1 << 20


@dataclass(frozen=True, slots=True)
class Attest:
    """ATTEST: what a holder verifies before it takes a hand-off's key. The header names the run, the epoch,
    the key's fingerprint and the CVM's key-exchange key (``link_pub``, hex); the payload carries the TDX quote,
    its collateral (JSON), the GPU's SPDM report and its PEM chain, their sizes in the header."""

    FRAME: ClassVar[FrameType] = FrameType.ATTEST
    run_id: str
    epoch: int
    key_fp: str
    link_pub: str
    quote: bytes
    collateral: bytes
    gpu_report: bytes
    gpu_chain: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"run": self.run_id, "epoch": self.epoch, "key_fp": self.key_fp, "link_pub": self.link_pub,
                "sizes": [len(getattr(self, k)) for k in _ATTEST_PARTS]}

    def payload(self) -> bytes:
        return b"".join(getattr(self, k) for k in _ATTEST_PARTS)

    @classmethod
    def from_frame(cls, h: Mapping[str, Any], payload: bytes | bytearray | memoryview) -> Attest:
        w = "ATTEST"
        sizes = _get(h, w, "sizes", _MISSING)
        if (not isinstance(sizes, list) or len(sizes) != len(_ATTEST_PARTS)
                or not all(type(n) is int and 0 <= n <= _MAX_EVIDENCE for n in sizes) or sum(sizes) != len(payload)):
            raise FrameError(f"{w} sizes do not describe its {len(payload)}-byte payload")
        raw, parts, at = bytes(payload), [], 0
        for n in sizes:
            parts.append(raw[at:at + n])
            at += n
        return cls(_str(h, w, "run", max_len=128), _int(h, w, "epoch"), _str(h, w, "key_fp", max_len=64),
                   _hex(h, w, "link_pub", nbytes=32), *parts)


@dataclass(frozen=True, slots=True)
class Verdict:
    """VERDICT: the holder's own verdict on an ATTEST (``report()`` is the run report's
    ``visits[].holder_attestation``), with its fresh nonce for the next hand-off (``next_nonce``)."""

    FRAME: ClassVar[FrameType] = FrameType.VERDICT
    epoch: int
    ok: bool
    cvm: Mapping[str, Any]  # {"ok", "tcb_status", "mr_td", "failed"}
    gpu: Mapping[str, Any]  # {"ok", "nonce", "claims_failed"}
    ms: float
    next_nonce: str
    #: what the agent checked against, as it states it (issue 30): {"source", "sha256", "roots": {"gpu", "tdx"},
    #: "mr_td_policy": "pinned" | "any"}; empty for an agent that predates it
    policy: Mapping[str, Any] = field(default_factory=dict)
    #: SHA-256 (hex) of the evidence the verdict is on: {"quote", "collateral", "gpu_report", "gpu_chain"}
    evidence: Mapping[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        h = {"epoch": self.epoch, "ok": self.ok, "cvm": dict(self.cvm), "gpu": dict(self.gpu), "ms": self.ms,
             "next_nonce": self.next_nonce}
        if self.policy:
            h["policy"] = dict(self.policy)
        if self.evidence:
            h["evidence"] = dict(self.evidence)
        return h

    @property
    def failed_claim(self) -> str | None:
        """The first claim that failed (CVM first), or None."""
        if not self.cvm.get("ok"):
            return str(self.cvm.get("failed") or "cvm")
        if not self.gpu.get("ok"):
            failed = self.gpu.get("claims_failed") or ["gpu"]
            return str(failed[0])
        return None

    def report(self) -> dict[str, Any]:
        """``visits[].holder_attestation`` and the ledger row's detail: the verdict, what it was checked against
        (``policy_source``, ``policy_sha256``, ``roots``, ``mr_td_policy``) and on which evidence."""
        claims_failed = list(self.gpu.get("claims_failed") or [])
        measres = None if not self.gpu.get("nonce") else ("fail" if "measres" in claims_failed or not
                                                           self.gpu.get("ok") else "success")
        return {"cvm": {"ok": bool(self.cvm.get("ok")), "tcb_status": self.cvm.get("tcb_status"),
                        "mr_td": self.cvm.get("mr_td")},
                "gpu": {"ok": bool(self.gpu.get("ok")), "nonce": self.gpu.get("nonce"),
                        "claims_failed": claims_failed, "measres": measres},
                "ms": self.ms, "failed_claim": self.failed_claim,
                "policy_source": self.policy.get("source"), "policy_sha256": self.policy.get("sha256"),
                "roots": dict(self.policy.get("roots") or {}), "mr_td_policy": self.policy.get("mr_td_policy"),
                "evidence_sha256": dict(self.evidence)}

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> Verdict:
        w = "VERDICT"
        cvm, gpu = _get(h, w, "cvm", _MISSING), _get(h, w, "gpu", _MISSING)
        if not isinstance(cvm, Mapping) or not isinstance(gpu, Mapping):
            raise FrameError(f"{w} cvm and gpu must be objects")
        failed = gpu.get("claims_failed") or []
        if not isinstance(failed, list) or len(failed) > 64 or not all(isinstance(c, str) and len(c) < 128
                                                                       for c in failed):
            raise FrameError(f"{w} gpu claims_failed must be a list of claim names")
        ms = _get(h, w, "ms", 0.0)
        if type(ms) not in (int, float) or not math.isfinite(ms) or ms < 0:
            raise FrameError(f"{w} ms must be a non-negative number")
        ok = _flag(h, w, "ok")
        cvm_v = {"ok": _flag(cvm, w, "ok"), "tcb_status": _str(cvm, w, "tcb_status", default=None, max_len=64),
                 "mr_td": _hex(cvm, w, "mr_td", nbytes=48, default=None),
                 "failed": _str(cvm, w, "failed", default=None, max_len=128)}
        gpu_v = {"ok": _flag(gpu, w, "ok"), "nonce": _hex(gpu, w, "nonce", nbytes=32, default=None),
                 "claims_failed": failed}
        return cls(epoch=_int(h, w, "epoch"), ok=ok and bool(cvm_v["ok"]) and bool(gpu_v["ok"]), cvm=cvm_v,
                   gpu=gpu_v, ms=float(ms), next_nonce=_hex(h, w, "next_nonce", nbytes=32),
                   policy=_verdict_policy(h, w), evidence=_verdict_evidence(h, w))


def _verdict_policy(h: Mapping[str, Any], w: str) -> dict[str, Any]:
    raw = h.get("policy")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise FrameError(f"{w} policy must be an object")
    roots = raw.get("roots") or {}
    if not isinstance(roots, Mapping) or len(roots) > 8 or not all(
            isinstance(k, str) and len(k) < 32 and isinstance(v, str) and len(v) < 128 for k, v in roots.items()):
        raise FrameError(f"{w} policy roots must be an object of at most 8 short names")
    mr_td_policy = _str(raw, w, "mr_td_policy", default=None, max_len=16)
    if mr_td_policy not in (None, "pinned", "any"):
        raise FrameError(f"{w} policy mr_td_policy must be 'pinned' or 'any'")
    return {"source": _source(raw, w), "sha256": _hex(raw, w, "sha256", nbytes=32, default=None),
            "roots": dict(roots), "mr_td_policy": mr_td_policy}


def _verdict_evidence(h: Mapping[str, Any], w: str) -> dict[str, str]:
    raw = h.get("evidence")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise FrameError(f"{w} evidence must be an object")
    return {k: _hex(raw, w, k, nbytes=32) for k in _ATTEST_PARTS if k in raw}


