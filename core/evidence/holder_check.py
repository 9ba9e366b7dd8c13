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
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from .cvm_snp import check_snp_cvm, cvm_kind
from .nvidia_spdm import CERTS_DIR, device_root, load_pem_chain
from .policy import EvidencePolicy, PolicyError, load_evidence_policy
from .spdm_claims import check_fresh_report, compare_measurements, verify_report
from .tdx import TdxVerdict, verify_tdx_quote
from .tdx_family import TdxQuoteFamilies, collateral_expiry

# the policy's names re-exported: what a holder's own configuration (``agents.holder.config``) reads through here
__all__ = ["CACHE_SIZE", "NVIDIA_DEVICE_ROOT", "EvidencePolicy", "HolderVerifier", "MEASRES", "PolicyError",
           "REPORT_DATA_CLAIM", "collateral_expiry", "load_evidence_policy", "load_golden"]

MEASRES = "measres"
REPORT_DATA_CLAIM = "report-data-binding"
#: NVIDIA's Device Identity CA as shipped (what ``device_root = "nvidia"`` pins)
NVIDIA_DEVICE_ROOT = CERTS_DIR / "nvidia_device_identity_ca.crt"
#: verdicts kept per kind (quotes with collateral, GPU chains); the oldest goes first (issue 30)
CACHE_SIZE = 16


def _remember(cache: OrderedDict[bytes, tuple[float, Any]], tag: bytes, until: float, value: Any) -> None:
    cache[tag] = (until, value)
    cache.move_to_end(tag)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def _recall(cache: OrderedDict[bytes, tuple[float, Any]], tag: bytes, now: float) -> Any:
    hit = cache.get(tag)
    if hit is None:
        return None
    if now >= hit[0]:  # the collateral or a certificate expired since: checked again (and refused)
        del cache[tag]
        return None
    return hit[1]


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
    #: checked once, kept until the collateral's or the chain's first expiry, at most CACHE_SIZE of each
    _tdx: OrderedDict[bytes, tuple[float, TdxVerdict]] | None = None
    _leaf: OrderedDict[bytes, tuple[float, x509.Certificate | list[str]]] | None = None
    #: the TDX policy's pinned root (DER), read once (a root that cannot be read is left to each check to name)
    _tdx_root_der: bytes | None = None

    @classmethod
    def load(cls, policy_path: Path, golden_path: Path) -> HolderVerifier:
        """Raises ``PolicyError`` or ``ValueError`` for a bad policy or golden file."""
        return cls(load_evidence_policy(policy_path), load_golden(golden_path))

    def __post_init__(self) -> None:
        root = self.policy.gpu.device_root
        self._root = x509.load_pem_x509_certificate(root.read_bytes()) if root is not None else device_root()
        self._tdx, self._leaf = OrderedDict(), OrderedDict()

    def check_cvm(self, quote: bytes, collateral: bytes, expected_report_data: bytes, *,
                  now: int | None = None, remember: bool = True,
                  families: TdxQuoteFamilies | None = None) -> dict[str, Any]:
        """``{"ok", "tcb_status", "mr_td", "failed"}``: the quote and collateral (once; cached until the
        collateral's first expiry, unless ``remember`` is off: a quote seen once, as the fleet key agreement's,
        need not pay for reading the collateral's dates), then its report data. With ``families`` (one
        agreement's, :class:`.tdx_family.TdxQuoteFamilies`), a quote of a family already checked in full there
        has its own signature checked and that family's verdict (the fleet-key agreement's quotes).

        An SEV-SNP CVM's evidence (its collateral says ``"kind": "snp"`` or ``"azure-snp"``) is checked by
        :func:`.cvm_snp.check_snp_cvm` under the policy's ``[amd-snp]``, with the same result keys.
        """
        if cvm_kind(collateral) != "tdx":
            return check_snp_cvm(quote, collateral, expected_report_data, self.policy.snp, now=now)
        assert self._tdx is not None
        tag = hashlib.sha256(quote + b"\0" + collateral).digest()
        at = time.time() if now is None else now
        verdict: TdxVerdict | None = _recall(self._tdx, tag, at)
        if verdict is None:
            def full() -> TdxVerdict:
                return verify_tdx_quote(quote, collateral, now=now, policy=self.policy.tdx,
                                        root_ca_der=self._pinned_tdx_root())

            verdict = full() if families is None else families.verify(quote, collateral, at, full)
            if verdict.ok and remember:  # a refusal is not kept: the next ATTEST is checked afresh
                _remember(self._tdx, tag, min(collateral_expiry(collateral), verdict.age_limit or float("inf")),
                          verdict)  # and not past the policy's max_collateral_age_days
        mr_td = verdict.mr_td.lower() or None
        if not verdict.ok:
            return {"ok": False, "tcb_status": verdict.tcb_status, "mr_td": mr_td, "failed": verdict.failed}
        if verdict.report_data.lower() != expected_report_data.hex():
            return {"ok": False, "tcb_status": verdict.tcb_status, "mr_td": mr_td, "failed": REPORT_DATA_CLAIM}
        return {"ok": True, "tcb_status": verdict.tcb_status, "mr_td": mr_td, "failed": None}

    def _pinned_tdx_root(self) -> bytes | None:
        root = self.policy.tdx.root_ca
        if self._tdx_root_der is None and root is not None:
            try:
                data = root.read_bytes()
                self._tdx_root_der = (x509.load_pem_x509_certificate(data).public_bytes(Encoding.DER)
                                      if b"-----BEGIN CERTIFICATE-----" in data else data)
            except (OSError, ValueError):
                return None  # verify_tdx_quote reads it again and refuses by name ("root-ca")
        return self._tdx_root_der

    def check_gpu(self, report: bytes, chain_pem: bytes, nonce: bytes) -> dict[str, Any]:
        """``{"ok", "nonce", "claims_failed"}``: the chain once (to the pinned root, FWID, arch; cached), then
        this report's parse, nonce and signature, and its measurements against the golden values."""
        assert self._leaf is not None and self._root is not None
        tag = hashlib.sha256(chain_pem).digest()
        now = dt.datetime.now(dt.UTC)
        known = _recall(self._leaf, tag, now.timestamp())
        if known is None:
            claims, _ = verify_report(report, chain_pem, nonce, root=self._root, at=now,
                                      expected_arch=self.policy.gpu.expected_arch)
            chain_claims = ("-cert-chain", "-cert-chain-fwid-match", "x-nvidia-gpu-arch-check")
            bad = [c.name for c in claims.failed() if c.name.endswith(chain_claims)]
            if bad:
                known = bad  # not kept: checked afresh next time
            else:
                chain = load_pem_chain(chain_pem)
                known = chain[0]
                _remember(self._leaf, tag, min(c.not_valid_after_utc.timestamp() for c in chain), known)
        if isinstance(known, list):  # the chain failed once: every report under it fails the same way
            return {"ok": False, "nonce": nonce.hex(), "claims_failed": list(known)}
        failed, parsed = check_fresh_report(report, known, nonce)
        claims_failed = [failed] if failed else []
        if parsed is not None and not failed:
            if not self.golden or compare_measurements(parsed, self.golden):
                claims_failed.append(MEASRES)
        return {"ok": not claims_failed, "nonce": nonce.hex(), "claims_failed": claims_failed}
