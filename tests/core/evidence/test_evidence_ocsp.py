"""OCSP for the GPU's chain (issue 31 item 3) against a local OCSP responder (127.0.0.1) that answers for a SIM
GPU's 5-certificate chain, signed by each certificate's issuer key: good passes; a revoked leaf, an unknown
certificate, a replayed nonce and a forged signature fail ``-cert-chain`` by name, with NVIDIA's claims-3.0
values."""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509 import ocsp

from gputravel.core.evidence.nvidia_gpu import GpuVerdict, verify_gpu
from gputravel.core.evidence.policy import GpuPolicy
from gputravel.core.evidence.sim_gpu import SimGpu

CHAIN = "x-nvidia-gpu-attestation-report-cert-chain"
REPORT_ONLY = GpuPolicy(require_rims=False)


@pytest.fixture(scope="module")
def gpu() -> SimGpu:
    return SimGpu.generate(seed=b"ocsp")


class Responder(BaseHTTPRequestHandler):
    """Answers OCSP requests for ``gpu``'s chain; ``mode`` makes it answer otherwise."""

    gpu: SimGpu
    mode = "good"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        req = ocsp.load_der_ocsp_request(self.rfile.read(int(self.headers["Content-Length"])))
        pki = self.gpu.pki
        rim = any(c.serial_number == req.serial_number for c in pki.rim_chain)
        chain, keys = (pki.rim_chain, pki.rim_chain_keys) if rim else (pki.chain, pki.chain_keys)
        pos = next(i for i, c in enumerate(chain) if c.serial_number == req.serial_number)
        cert, issuer, issuer_key = chain[pos], chain[pos + 1], keys[pos + 1]
        nonce = req.extensions.get_extension_for_class(x509.OCSPNonce).value.nonce
        status, revoked_at, reason = ocsp.OCSPCertStatus.GOOD, None, None
        if (self.mode == "revoked" and pos == 0 and not rim) or (self.mode == "revoked-rim" and rim):
            status, revoked_at, reason = (ocsp.OCSPCertStatus.REVOKED, dt.datetime(2025, 1, 1),
                                          x509.ReasonFlags.key_compromise)
        elif self.mode == "unknown" and pos == 0:
            status = ocsp.OCSPCertStatus.UNKNOWN
        if self.mode == "replay":
            nonce = os.urandom(32)
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        signer, extra = issuer, []
        if self.mode == "forged":  # a responder certificate the issuer never made, under the issuer's name
            issuer_key = ec.generate_private_key(ec.SECP384R1())
            signer = (x509.CertificateBuilder().subject_name(issuer.subject).issuer_name(issuer.subject)
                      .public_key(issuer_key.public_key()).serial_number(7)
                      .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=1))
                      .sign(issuer_key, hashes.SHA384()))
            extra = [signer]
        builder = (ocsp.OCSPResponseBuilder()
                   .add_response(cert=cert, issuer=issuer, algorithm=hashes.SHA384(), cert_status=status,
                                 this_update=now - dt.timedelta(minutes=5), next_update=now + dt.timedelta(hours=1),
                                 revocation_time=revoked_at, revocation_reason=reason)
                   .responder_id(ocsp.OCSPResponderEncoding.HASH, signer)
                   .add_extension(x509.OCSPNonce(nonce), critical=False))
        if extra:
            builder = builder.certificates(extra)
        resp = builder.sign(issuer_key, hashes.SHA384())
        body = resp.public_bytes(Encoding.DER)
        self.send_response(200)
        self.send_header("Content-Type", "application/ocsp-response")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def responder(gpu: SimGpu) -> Iterator[tuple[str, type[Responder]]]:
    handler = type("Handler", (Responder,), {"gpu": gpu, "mode": "good"})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def _verdict(gpu: SimGpu, url: str) -> tuple[bool, dict[str, object], str]:
    nonce = os.urandom(32)
    verdict = verify_gpu(gpu.report(nonce), gpu.cert_chain_pem(), nonce, policy=REPORT_ONLY,
                         device_root=gpu.pki.device_root, ocsp_url=url)
    claim = verdict.claims[CHAIN]
    return verdict.ok, dict(claim.value), claim.detail


def test_a_chain_good_by_ocsp_passes(gpu: SimGpu, responder: tuple[str, type[Responder]]) -> None:
    ok, value, detail = _verdict(gpu, responder[0])
    assert ok and value["x-nvidia-cert-ocsp-status"] == "good" and value["x-nvidia-cert-status"] == "valid"
    assert "4 certificates good by OCSP" in detail


@pytest.mark.parametrize(("mode", "ocsp_status", "why"), [
    ("revoked", "revoked", "revoked (key_compromise)"),
    ("unknown", "unknown", "does not know"),
    ("replay", "unknown", "nonce"),
    ("forged", "unknown", "not one the issuer certified"),
])
def test_a_bad_ocsp_answer_fails_the_chain_claim_by_name(gpu: SimGpu, responder: tuple[str, type[Responder]],
                                                         mode: str, ocsp_status: str, why: str) -> None:
    url, handler = responder
    handler.mode = mode
    ok, value, detail = _verdict(gpu, url)
    assert not ok and value["x-nvidia-cert-ocsp-status"] == ocsp_status and why in detail
    if mode == "revoked":
        assert value["x-nvidia-cert-status"] == "revoked" and value["x-nvidia-cert-revocation-reason"] == "key_compromise"


def test_an_unreachable_ocsp_service_fails_the_chain_claim(gpu: SimGpu) -> None:
    ok, value, detail = _verdict(gpu, "http://127.0.0.1:9")
    assert not ok and "no OCSP answer" in detail


def test_rim_chains_are_asked_about_too_and_a_revoked_rim_signer_fails_its_claim(
        gpu: SimGpu, responder: tuple[str, type[Responder]]) -> None:
    url, handler = responder
    nonce = os.urandom(32)
    report, chain, rims = gpu.report(nonce), gpu.cert_chain_pem(), list(gpu.rims())

    def verdict() -> GpuVerdict:
        return verify_gpu(report, chain, nonce, rims=rims, device_root=gpu.pki.device_root,
                          rim_root=gpu.pki.rim_root, ocsp_url=url)

    good = verdict()
    assert good.ok, good.failed
    assert good.claims["x-nvidia-gpu-driver-rim-cert-chain"].value["x-nvidia-cert-ocsp-status"] == "good"
    handler.mode = "revoked-rim"
    bad = verdict()
    assert bad.failed is not None and bad.failed.name == "x-nvidia-gpu-driver-rim-cert-chain"
    assert bad.claims["x-nvidia-gpu-driver-rim-cert-chain"].value["x-nvidia-cert-status"] == "revoked"
