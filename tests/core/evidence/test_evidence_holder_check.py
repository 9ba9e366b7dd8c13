"""The holder's GPU check keys on the chain claims by name: after the claims-3.0 rename (``-cert-chain``), a chain
that is not under the holder's pinned root must still fail and never be cached as a good leaf (a guard for merges
that keep the old name ``-cert-chain-validated``, which would let a foreign chain's leaf through)."""

from __future__ import annotations

import os

from gputravel.core.evidence.holder_check import HolderVerifier
from gputravel.core.evidence.policy import EvidencePolicy, GpuPolicy
from gputravel.core.evidence.sim_gpu import SimGpu


def test_a_gpu_chain_not_under_the_pinned_root_fails_every_time() -> None:
    gpu = SimGpu.generate(seed=b"holder-check")
    verifier = HolderVerifier(EvidencePolicy(gpu=GpuPolicy()), {})  # NVIDIA's root pinned
    for _ in range(2):  # the second time from what the first one remembered
        nonce = os.urandom(32)
        answer = verifier.check_gpu(gpu.report(nonce), gpu.cert_chain_pem(), nonce)
        assert answer["ok"] is False
        assert "x-nvidia-gpu-attestation-report-cert-chain" in answer["claims_failed"]
