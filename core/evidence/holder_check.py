"""The holder's own checks (issue 22 item 5): the orchestrator CVM's TDX quote (or SEV-SNP report, issue 31) and
the GPU's SPDM evidence.

What a holder agent imports (stdlib, ``cryptography``, ``dcap_qvl``; no XML stack, no RIMs): the chain of the GPU
and the quote with its collateral are checked once (cached by their SHA-256), each hand-off's report only for
its parse, nonce, signature and measurements. Golden measurements are the holder's own, approved by its operator
(``golden.json``: ``{"measurements": [hex, ...]}`` with RIM index i at position i, or ``{"golden": {"i": [hex,
...]}}`` with alternatives); the holder does not read RIMs (its operator checks them offline with
``gputravel attest --rim`` before approving the values). The pinned roots come from an evidence policy file
(``policy.load_evidence_policy``): NVIDIA's and Intel's by default, the SIM roots for the emulated platform.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from .cvm_snp import check_snp_cvm, cvm_kind
from .nvidia_spdm import check_fresh_report, compare_measurements, device_root, load_pem_chain, verify_report
from .policy import EvidencePolicy, load_evidence_policy
from .tdx import TdxVerdict, verify_tdx_quote

__all__ = ["HolderVerifier", "MEASRES", "REPORT_DATA_CLAIM", "load_golden"]

MEASRES = "measres"
REPORT_DATA_CLAIM = "report-data-binding"


def load_golden(path: Path) -> dict[int, tuple[bytes, ...]]:
    """The holder's approved golden measurements: ``{rim_index: (allowed values...)}``.

    Raises:
        ValueError: unreadable or not one of the two shapes.
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(doc.get("golden"), dict):
            return {int(k): tuple(bytes.fromhex(v) for v in vs) for k, vs in doc["golden"].items()}
        return {i: (bytes.fromhex(v),) for i, v in enumerate(doc["measurements"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a golden-measurement file ({exc})") from None


@dataclass(slots=True)
class HolderVerifier:
    """One holder's verifier: its pinned roots, TDX policy and golden measurements, and what it checked once."""

    policy: EvidencePolicy
    golden: dict[int, tuple[bytes, ...]]
    _root: x509.Certificate | None = None
    _tdx: dict[bytes, TdxVerdict] | None = None
    _leaf: dict[bytes, x509.Certificate | list[str]] | None = None

    @classmethod
    def load(cls, policy_path: Path, golden_path: Path) -> HolderVerifier:
        """Raises ``PolicyError`` or ``ValueError`` for a bad policy or golden file."""
        return cls(load_evidence_policy(policy_path), load_golden(golden_path))

    def __post_init__(self) -> None:
        root = self.policy.gpu.device_root
        self._root = x509.load_pem_x509_certificate(root.read_bytes()) if root is not None else device_root()
        self._tdx, self._leaf = {}, {}

    def check_cvm(self, quote: bytes, collateral: bytes, expected_report_data: bytes, *,
                  now: int | None = None) -> dict[str, Any]:
        """``{"ok", "tcb_status", "failed"}``: the quote and collateral (once; cached), then its report data.

        An SEV-SNP CVM's evidence (its collateral says ``"kind": "snp"`` or ``"azure-snp"``) is checked by
        :func:`.cvm_snp.check_snp_cvm` under the policy's ``[amd-snp]``, with the same result keys.
        """
        if cvm_kind(collateral) != "tdx":
            return check_snp_cvm(quote, collateral, expected_report_data, self.policy.snp, now=now)
        assert self._tdx is not None
        tag = hashlib.sha256(quote + b"\0" + collateral).digest()
        verdict = self._tdx.get(tag)
        if verdict is None:
            verdict = verify_tdx_quote(quote, collateral, now=now, policy=self.policy.tdx)
            if len(self._tdx) > 16:
                self._tdx.clear()
            self._tdx[tag] = verdict
        if not verdict.ok:
            return {"ok": False, "tcb_status": verdict.tcb_status, "failed": verdict.failed}
        if verdict.report_data.lower() != expected_report_data.hex():
            return {"ok": False, "tcb_status": verdict.tcb_status, "failed": REPORT_DATA_CLAIM}
        return {"ok": True, "tcb_status": verdict.tcb_status, "failed": None}

    def check_gpu(self, report: bytes, chain_pem: bytes, nonce: bytes) -> dict[str, Any]:
        """``{"ok", "nonce", "claims_failed"}``: the chain once (to the pinned root, FWID, arch; cached), then
        this report's parse, nonce and signature, and its measurements against the golden values."""
        assert self._leaf is not None and self._root is not None
        tag = hashlib.sha256(chain_pem).digest()
        known = self._leaf.get(tag)
        if known is None:
            claims, _ = verify_report(report, chain_pem, nonce, root=self._root, at=dt.datetime.now(dt.UTC),
                                      expected_arch=self.policy.gpu.expected_arch)
            chain_claims = ("-cert-chain", "-cert-chain-fwid-match", "x-nvidia-gpu-arch-check")
            bad = [c.name for c in claims.failed() if c.name.endswith(chain_claims)]
            known = bad if bad else load_pem_chain(chain_pem)[0]
            self._leaf[tag] = known
        if isinstance(known, list):  # the chain failed once: every report under it fails the same way
            return {"ok": False, "nonce": nonce.hex(), "claims_failed": list(known)}
        failed, parsed = check_fresh_report(report, known, nonce)
        claims_failed = [failed] if failed else []
        if parsed is not None and not failed:
            if not self.golden or compare_measurements(parsed, self.golden):
                claims_failed.append(MEASRES)
        return {"ok": not claims_failed, "nonce": nonce.hex(), "claims_failed": claims_failed}
