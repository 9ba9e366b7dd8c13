"""The holder's own attestation (issue 22 item 5): before it takes a provisioning key, the agent verifies the
orchestrator CVM's TDX quote (its report data must bind the CVM's key-exchange key and the run) and the GPU's
SPDM evidence for this hand-off under a fresh nonce of its own, bound to the window's key.

The agent's nonce travels ahead (in HELLO, then in each VERDICT for the next hand-off), so no extra round trip
is needed for it: ATTEST -> VERDICT is the one round trip, and the key comes only after an ok VERDICT, wrapped
for this agent under the attested key exchange (``core.protocol.keywrap``). A HANDOFF whose key was not attested
(a plain key, another epoch or fingerprint, a failed verdict) is refused: no key is used, no data leaves.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from gputravel.core.evidence.holder_check import HolderVerifier
from gputravel.core.protocol.cipher import Direction
from gputravel.core.protocol.errors import ConfigError, FrameError, HolderAttestationError
from gputravel.core.protocol.holderattest import ATTEST_PARTS, CvmCheck, GpuCheck, VerdictPolicy
from gputravel.core.protocol.holderlink import Attest, Handoff, ProvisioningKey, Verdict
from gputravel.core.protocol.keys import KEY_LEN
from gputravel.core.protocol.keywrap import (
    LinkKey,
    conventional_secret,
    cvm_report_data,
    spdm_nonce,
    unwrap_key,
)

__all__ = ["HolderAttestation"]


class HolderAttestation:
    """One agent's attestation state: its verifier, its key-exchange key, its current nonce, the last verdict."""

    def __init__(self, verifier: HolderVerifier, *, policy: Mapping[str, Any] | None = None,
                 allow_conventional: bool = True) -> None:
        self.verifier = verifier
        self.link_key = LinkKey()
        self.nonce = os.urandom(32)
        #: (epoch, key fingerprint, run id, the CVM's key-exchange key) of the last ok verdict; None: nothing attested
        self.attested: tuple[int, str, str, bytes] | None = None
        #: what every verdict states it was checked against (issue 30): source, sha256, roots, mr_td_policy
        self.policy: dict[str, Any] = dict(policy or {})
        #: a conventional hand-off is refused unless allowed; allowed, its data is sealed to the attested CVM
        self.allow_conventional = allow_conventional
        #: the last ATTEST this agent verified and its verdict (the receipt of the hand-off that follows)
        self.last: tuple[Attest, Verdict] | None = None

    @classmethod
    def load(cls, policy: Path, golden: Path) -> HolderAttestation:
        """An agent started with ``--attest-policy``/``--golden``: the orchestrator chose what it checks."""
        try:
            verifier = HolderVerifier.load(policy, golden)
        except ValueError as exc:  # PolicyError is a ValueError too
            raise ConfigError(f"cannot load the holder's attestation policy: {exc}") from None
        from gputravel.agents.holder.config import policy_summary

        digest, roots = policy_summary(verifier.policy, verifier.golden, allow_conventional=True,
                                       accept_any_td=not verifier.policy.tdx.mr_td)
        return cls(verifier, policy={"source": "orchestrator", "sha256": digest, "roots": roots,
                                     "mr_td_policy": "pinned" if verifier.policy.tdx.mr_td else "any"})

    def verify(self, msg: Attest) -> Verdict:
        """The holder's verdict on one ATTEST; the nonce is spent whatever the outcome."""
        t0 = time.perf_counter()
        nonce, self.nonce = self.nonce, os.urandom(32)
        self.attested = None
        link_pub = bytes.fromhex(msg.link_pub)
        cvm = self.verifier.check_cvm(msg.quote, msg.collateral, cvm_report_data(link_pub, msg.run_id))
        gpu = self.verifier.check_gpu(msg.gpu_report, msg.gpu_chain, spdm_nonce(nonce, msg.key_fp, msg.epoch))
        ok = bool(cvm["ok"] and gpu["ok"])
        if ok:
            self.attested = (msg.epoch, msg.key_fp, msg.run_id, link_pub)
            self.link_key.prepare(link_pub, msg.run_id.encode())  # the key's unwrap, off the hand-off's path
        evidence = {k: hashlib.sha256(part).hexdigest() for k, part in zip(ATTEST_PARTS, msg.parts(), strict=True)}
        verdict = Verdict(epoch=msg.epoch, ok=ok, cvm=CvmCheck.from_wire(cvm), gpu=GpuCheck.from_wire(gpu),
                          ms=round((time.perf_counter() - t0) * 1e3, 3), next_nonce=self.nonce.hex(),
                          policy=VerdictPolicy.from_wire(self.policy) if self.policy else None, evidence=evidence)
        self.last = (msg, verdict)
        return verdict

    def expects(self, h: Handoff) -> bool:
        """Whether ``h`` is the hand-off this agent's last ok verdict is for: of that epoch, its key wrapped for
        this agent with that fingerprint (a relayed copy is taken only then; ``accept`` checks the key itself)."""
        att = self.attested
        return att is not None and h.epoch == att[0] and h.key is None and h.wrapped_key is not None \
            and h.key_fp == att[1] and not h.conventional

    def accept(self, h: Handoff) -> Handoff:
        """The hand-off with its key unwrapped, if (and only if) this agent attested it; else ``HolderAttestationError``
        (code ``attestation``) and the key is never looked at."""
        att, self.attested = self.attested, None  # one verdict, one hand-off
        if att is None:
            raise HolderAttestationError("no attested evidence for this hand-off: the key is refused")
        epoch, key_fp, run_id, link_pub = att
        if h.epoch != epoch:
            raise HolderAttestationError(f"hand-off of epoch {h.epoch}, attested epoch {epoch}: refused")
        if h.conventional:  # never plaintext: sealed to the attested CVM under the same key exchange (issue 30)
            if not self.allow_conventional:
                raise HolderAttestationError("a conventional hand-off is refused: this holder accepts only hand-offs "
                                             "sealed for the GPU (`gputravel holder init --allow-conventional` "
                                             "allows it)")
            secret = conventional_secret(self.link_key, link_pub, run_id, epoch)
            return replace(h, key=ProvisioningKey(secret[:KEY_LEN], secret[KEY_LEN:], epoch,
                                                  int(Direction.HOLDER_TO_DEVICE)), run_id=run_id)
        if h.wrapped_key is None or h.key_fp != key_fp:
            raise HolderAttestationError("the hand-off's key is not the attested one (or not wrapped for this holder)")
        try:
            secret = unwrap_key(self.link_key, link_pub, run_id.encode(), h.wrapped_key, epoch=epoch,
                                fingerprint=key_fp)
        except FrameError as exc:
            raise HolderAttestationError(exc.reason) from None
        key = ProvisioningKey(secret[:KEY_LEN], secret[KEY_LEN:], epoch, int(Direction.HOLDER_TO_DEVICE))
        if key.fingerprint != key_fp:
            raise HolderAttestationError("the unwrapped key's fingerprint is not the attested one")
        return replace(h, key=key, wrapped_key=None, run_id=run_id)
