"""17 single-change variants of NVIDIA's H100 sample, each with NVIDIA's verdict beside ours (issue 31 item 4).

NVIDIA's column is what nv-local-gpu-verifier 2.7.3 does with the variant, read from its code in the pinned wheel
(never installed, never run here): ``cc_admin.py`` (the order of checks), ``CcAdminUtils.verify_certificate_chain``
and ``verify_attestation_report``, ``nvml/gpu_cert_chains.py`` (the GPU chain's top replaced by the pinned root),
``rim/__init__.py`` (the RIM root appended, signxml with the root as CA), ``OpaqueData.parse`` (types looked up in
a table: an unknown one raises), ``config.check_status`` (the overall result). Rows marked ``stricter`` are the
documented places where gputravel refuses what NVIDIA accepts, or refuses earlier (docs/attestation.md, the table
"Where gputravel is stricter than NVIDIA's verifier"); every other row has the same verdict and the same claim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding
from evidence_samples import (  # noqa: F401 (the *_fixture names are pytest fixtures)
    RIM_VALID_AT,
    SAMPLE_NONCE,
    NvidiaSample,
    RecordedNvml,
    nv_wheel_fixture,
    sample_fixture,
)

from gputravel.core.attestation.hardware_evidence import gpu_evidence_from_nvml
from gputravel.core.errors import AttestationError
from gputravel.core.evidence.nvidia_gpu import verify_gpu
from gputravel.core.evidence.nvidia_rim import verify_rim
from gputravel.core.evidence.nvidia_spdm import parse_report, read_hex_or_raw
from gputravel.core.evidence.policy import GpuPolicy
from gputravel.core.evidence.sim_gpu import SimGpu
from gputravel.core.evidence.sim_rim import make_rim

P = "x-nvidia-gpu-attestation-report"
REPORT_ONLY = GpuPolicy(require_rims=False)


@dataclass(frozen=True)
class Variant:
    name: str
    nvidia: str  # "pass" or the claim NVIDIA's verifier marks false first
    ours: str  # "pass" or the claim we name first
    stricter: bool = False  # a documented row where we refuse what NVIDIA passes, or refuse at an earlier claim


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x01
    return bytes(out)


def _pems(chain: bytes) -> list[bytes]:
    return re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n?", chain, re.S)


def _opaque_offset(raw: bytes) -> int:
    rec_len = int.from_bytes(raw[37 + 5:37 + 8], "little")
    return 37 + 8 + rec_len + 32 + 2


def _report_variant(sample: NvidiaSample, name: str) -> tuple[bytes, bytes, bytes]:
    raw, chain, nonce = read_hex_or_raw(sample.report), sample.chain, SAMPLE_NONCE
    if name == "another-nonce":
        nonce = _flip(nonce, 0)
    elif name == "nonce-byte-in-report":
        raw = _flip(raw, 4)
    elif name == "measurement-byte":
        raw = _flip(raw, 37 + 8 + 7 + 10)
    elif name == "fwid-in-report":
        raw = raw.replace(bytes.fromhex("f5c384aebb579217"), bytes.fromhex("f5c384aebb579218"))
    elif name == "signature-byte":
        raw = _flip(raw, len(raw) - 1)
    elif name in ("leaf-certificate-byte", "intermediate-certificate-byte", "root-certificate-byte"):
        pems = _pems(chain)
        pos = {"leaf-certificate-byte": 0, "intermediate-certificate-byte": 2, "root-certificate-byte": 4}[name]
        der = x509.load_pem_x509_certificate(pems[pos]).public_bytes(Encoding.DER)
        pems[pos] = x509.load_der_x509_certificate(_flip(der, len(der) - 3)).public_bytes(Encoding.PEM)
        chain = b"".join(pems)
    elif name == "chain-of-four":
        chain = b"".join(_pems(chain)[:4])
    elif name == "truncated-by-100":
        raw = raw[:-100]
    elif name == "spdm-1.2-version-bytes":
        raw = bytes([0x12]) + raw[1:37] + bytes([0x12]) + raw[38:]
    elif name == "unknown-opaque-type":
        at = _opaque_offset(raw)
        raw = raw[:at] + (26).to_bytes(2, "little") + raw[at + 2:]  # 26: no type in NVIDIA's table
    return raw, chain, nonce


REPORT_VARIANTS = [
    Variant("unchanged", "pass", "pass"),
    Variant("another-nonce", f"{P}-nonce-match", f"{P}-nonce-match"),
    Variant("nonce-byte-in-report", f"{P}-nonce-match", f"{P}-nonce-match"),
    Variant("measurement-byte", f"{P}-signature-verified", f"{P}-signature-verified"),
    Variant("fwid-in-report", f"{P}-cert-chain-fwid-match", f"{P}-cert-chain-fwid-match"),
    Variant("signature-byte", f"{P}-signature-verified", f"{P}-signature-verified"),
    Variant("leaf-certificate-byte", f"{P}-cert-chain", f"{P}-cert-chain"),
    Variant("intermediate-certificate-byte", f"{P}-cert-chain", f"{P}-cert-chain"),
    # NVIDIA drops the GPU's own top certificate and appends its pinned root: a changed root is never read
    Variant("root-certificate-byte", "pass", f"{P}-cert-chain", stricter=True),
    Variant("chain-of-four", f"{P}-cert-chain", f"{P}-cert-chain"),
    # NVIDIA slices without checking lengths and fails on the (now short) signature; we refuse at parse
    Variant("truncated-by-100", f"{P}-signature-verified", f"{P}-parsed", stricter=True),
    # both parse SPDM 1.2; the version byte is signed, so the changed sample's signature fails in both
    Variant("spdm-1.2-version-bytes", f"{P}-signature-verified", f"{P}-signature-verified"),
    Variant("unknown-opaque-type", f"{P}-parsed", f"{P}-parsed"),
]


@pytest.mark.parametrize("variant", REPORT_VARIANTS, ids=lambda v: v.name)
def test_report_variant_verdicts_side_by_side(sample: NvidiaSample, variant: Variant) -> None:
    raw, chain, nonce = _report_variant(sample, variant.name)
    verdict = verify_gpu(raw, chain, nonce, policy=REPORT_ONLY)
    ours = "pass" if verdict.ok else verdict.failed.name if verdict.failed else "?"
    assert ours == variant.ours, verdict.failed
    if not variant.stricter:
        assert ours == variant.nvidia
    else:
        assert variant.nvidia != variant.ours and (variant.nvidia == "pass") <= (ours != "pass")


def test_variant_14_driver_version_differs_from_the_drivers(sample: NvidiaSample) -> None:
    # NVIDIA: DriverVersionMismatchError (verify_attestation_report); ours: the hardware path refuses, named
    row = Variant("driver-version-differs-from-nvml", f"{P}-driver-version-match", f"{P}-driver-version-match")
    with pytest.raises(AttestationError, match=row.ours):
        gpu_evidence_from_nvml(RecordedNvml(sample, driver="550.90.12"), 0, SAMPLE_NONCE)
    assert row.ours == row.nvidia


def _self_made_rim() -> bytes:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "HCC RIM L4 Signer")])
    import datetime as dt

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(7).not_valid_before(dt.datetime(2024, 1, 1, tzinfo=dt.UTC))
            .not_valid_after(dt.datetime(2030, 1, 1, tzinfo=dt.UTC)).sign(key, hashes.SHA384()))
    return make_rim("96.00.5E.00.01", {0: [bytes(48)]}, [cert], key)


def _without_root(rim: bytes) -> bytes:
    certs = list(re.finditer(rb"<ds:X509Certificate>.*?</ds:X509Certificate>", rim, re.S))
    assert len(certs) == 4
    return rim[:certs[-1].start()] + rim[certs[-1].end():]


RIM_VARIANTS: list[tuple[Variant, Callable[[NvidiaSample], bytes]]] = [
    (Variant("rim-self-made-one-certificate", "-rim-cert-chain", "-rim-cert-chain"), lambda s: _self_made_rim()),
    (Variant("rim-for-another-version", "-rim-version-match", "-rim-version-match"), lambda s: s.vbios_rim),
    # NVIDIA appends its root to whatever the RIM carries; we want the pinned root itself on top of the RIM's chain
    (Variant("rim-chain-without-its-root", "pass", "-rim-cert-chain", stricter=True),
     lambda s: _without_root(s.vbios_rim)),
]


@pytest.mark.parametrize(("variant", "make"), RIM_VARIANTS, ids=lambda v: getattr(v, "name", ""))
def test_rim_variant_verdicts_side_by_side(sample: NvidiaSample, variant: Variant,
                                           make: Callable[[NvidiaSample], bytes]) -> None:
    expected = "96.00.9f.00.01" if variant.name == "rim-for-another-version" else "96.00.5E.00.01"
    claims, rim = verify_rim(make(sample), expected_version=expected, kind="vbios", at=RIM_VALID_AT)
    first = next((c.name for c in claims if c.ok is False), "pass")
    ours = first.removeprefix("x-nvidia-gpu-vbios")
    assert ours == variant.ours, first
    assert (ours == variant.nvidia) != variant.stricter
    if variant.name == "rim-self-made-one-certificate":
        assert claims["x-nvidia-gpu-vbios-rim-signature-verified"].ok is False  # the hole: no longer True


def test_the_table_has_17_variants_and_names_its_stricter_rows() -> None:
    rows = [*REPORT_VARIANTS, Variant("driver-version-differs-from-nvml", "", ""), *(v for v, _ in RIM_VARIANTS)]
    assert len(rows) == 17
    assert [r.name for r in rows if r.stricter] == ["root-certificate-byte", "truncated-by-100",
                                                      "rim-chain-without-its-root"]


# --- SPDM 1.2 and 1.3 that are signed as such parse and verify (SIM GPU, its own roots) -----------------------
def _resigned(gpu: SimGpu, nonce: bytes, version: int, *, opaque_type: int | None = None) -> bytes:
    raw = gpu.report(nonce)
    req, resp = bytearray(raw[:37]), bytearray(raw[37:-96])
    req[0] = resp[0] = version
    if opaque_type is not None:
        at = _opaque_offset(bytes(req + resp)) - 37
        resp[at:at + 2] = opaque_type.to_bytes(2, "little")
    if version == 0x13:
        context = b"ctx-1.3!"
        req += context
        resp += context
    r, s = decode_dss_signature(gpu.pki.leaf_key.sign(bytes(req + resp), ec.ECDSA(hashes.SHA384())))
    return bytes(req + resp) + r.to_bytes(48, "big") + s.to_bytes(48, "big")


@pytest.mark.parametrize("version", [0x11, 0x12, 0x13])
def test_sim_spdm_reports_of_each_version_verify(version: int) -> None:
    gpu = SimGpu.generate(seed=b"spdm")
    nonce = bytes(range(32))
    raw = _resigned(gpu, nonce, version)
    assert parse_report(raw).driver_version == gpu.driver_version
    verdict = verify_gpu(raw, gpu.cert_chain_pem(), nonce, rims=list(gpu.rims()), device_root=gpu.pki.device_root,
                         rim_root=gpu.pki.rim_root)
    assert verdict.ok, verdict.failed


def test_a_signed_report_with_an_unknown_opaque_type_is_refused_at_parse() -> None:
    gpu = SimGpu.generate(seed=b"opaque")
    nonce = bytes(32)
    verdict = verify_gpu(_resigned(gpu, nonce, 0x11, opaque_type=30), gpu.cert_chain_pem(), nonce,
                         device_root=gpu.pki.device_root, policy=REPORT_ONLY)
    assert verdict.failed is not None and verdict.failed.name == f"{P}-parsed"
    assert "unknown type 30" in verdict.failed.detail


def test_a_13_response_whose_context_differs_from_the_requests_is_refused() -> None:
    gpu = SimGpu.generate(seed=b"ctx")
    raw = bytearray(_resigned(gpu, bytes(32), 0x13))
    raw[40] ^= 1  # inside the request's RequesterContext
    verdict = verify_gpu(bytes(raw), gpu.cert_chain_pem(), bytes(32), device_root=gpu.pki.device_root,
                         policy=REPORT_ONLY)
    assert verdict.failed is not None and verdict.failed.name == f"{P}-parsed"
