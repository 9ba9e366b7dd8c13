"""NVIDIA's own GPU evidence sample, read from the pinned ``nv-local-gpu-verifier`` wheel (never installed), and a
helper that re-signs one of NVIDIA's RIMs under a test root (for the paths NVIDIA's sample RIMs cannot reach)."""

from __future__ import annotations

import datetime as dt
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from conftest import REQUIRE_DOWNLOADS_ENV, download_cache, pinned_download
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.core.evidence.nvidia_spdm import read_hex_or_raw
from gputravel.core.files import sha256_file

NV_REQUIREMENT = "nv-local-gpu-verifier==2.7.3"
NV_WHEEL = "nv_local_gpu_verifier-2.7.3-py3-none-any.whl"
NV_WHEEL_SHA256 = "27259ce3d828ca102db17f4b70c7b85c1882a55f99153eb706fcb1866db0fe7a"
SAMPLE_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
DRIVER_RIM = "Driver_RIM_test_no_gpu.swidtag"  # colloquialVersion 545.00
VBIOS_RIM = "1010_0200_882_96005E0001_PROD.swidtag"  # colloquialVersion 96.00.5E.00.01
# inside the RIM signing chain's validity (its leaf expired in June 2025)
RIM_VALID_AT = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class NvidiaSample:
    report: bytes  # hex text, as NVIDIA ships it
    chain: bytes  # PEM, leaf first
    driver_rim: bytes
    vbios_rim: bytes
    device_root_pem: bytes
    rim_root_pem: bytes


def read_sample(wheel: Path) -> NvidiaSample:
    with zipfile.ZipFile(wheel) as zf:
        def member(name: str) -> bytes:
            return zf.read(f"verifier/{name}")

        return NvidiaSample(
            report=member("samples/hopperAttestationReport.txt"),
            chain=member("samples/hopperCertChain.txt"),
            driver_rim=member(f"samples/{DRIVER_RIM}"),
            vbios_rim=member(f"samples/{VBIOS_RIM}"),
            device_root_pem=member("certs/verifier_device_root.pem"),
            rim_root_pem=member("certs/verifier_RIM_root.pem"),
        )


@dataclass(frozen=True)
class TestRimSigner:
    """A two-level test PKI (root -> signer) that signs RIM XML; its root is passed as ``rim_root``."""

    root: x509.Certificate
    signer: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _cert(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey, signing_key: ec.EllipticCurvePrivateKey,
          *, ca: bool) -> x509.Certificate:
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                                         crl_sign=ca, encipher_only=False, decipher_only=False), critical=True)
            .sign(signing_key, hashes.SHA384()))


def make_rim_signer() -> TestRimSigner:
    root_key = ec.generate_private_key(ec.SECP384R1())
    key = ec.generate_private_key(ec.SECP384R1())
    root = _cert("gputravel TEST RIM root", "gputravel TEST RIM root", root_key, root_key, ca=True)
    signer = _cert("gputravel TEST RIM signer", "gputravel TEST RIM root", key, root_key, ca=False)
    return TestRimSigner(root=root, signer=signer, key=key)


def resign_rim(template: bytes, signer: TestRimSigner, *, version: str,
               values: dict[int, list[bytes]]) -> bytes:
    """NVIDIA's RIM ``template`` with its signature removed, ``colloquialVersion`` and the listed indices'
    values replaced (several values = alternatives), re-signed (enveloped, ECDSA P-384) by ``signer``."""
    from lxml import etree
    from signxml import SignatureMethod, XMLSigner

    swid = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
    sha = "http://www.w3.org/2001/04/xmlenc#sha384"
    tree = etree.fromstring(template, etree.XMLParser(resolve_entities=False))
    for sig in tree.findall("{http://www.w3.org/2000/09/xmldsig#}Signature"):
        tree.remove(sig)
    tree.find(f"{{{swid}}}Meta").set("colloquialVersion", version)
    for res in tree.find(f"{{{swid}}}Payload").iter(f"{{{swid}}}Resource"):
        index = int(res.get("index"))
        if index not in values:
            continue
        for attr in [a for a in res.attrib if a.startswith(f"{{{sha}}}Hash")]:
            del res.attrib[attr]
        for i, v in enumerate(values[index]):
            res.set(f"{{{sha}}}Hash{i}", v.hex())
        res.set("alternatives", str(len(values[index])))
        res.set("active", "True")
    pem = [c.public_bytes(serialization.Encoding.PEM).decode() for c in (signer.signer, signer.root)]
    signed = XMLSigner(signature_algorithm=SignatureMethod.ECDSA_SHA384, digest_algorithm="sha384").sign(
        tree, key=signer.key, cert=pem)
    return bytes(etree.tostring(signed, xml_declaration=True, encoding="utf-8"))


@pytest.fixture(scope="session", name="nv_wheel")
def nv_wheel_fixture() -> Path:
    """The pinned wheel from the project's download cache, downloaded into it the first time (skip offline)."""
    from gputravel.core.errors import DataError
    from gputravel.core.training.tokens import pip_download

    path = download_cache() / NV_WHEEL
    if not (path.is_file() and sha256_file(path) == NV_WHEEL_SHA256):
        try:
            with pinned_download():
                pip_download(NV_REQUIREMENT, NV_WHEEL_SHA256, path.parent)
        except DataError as exc:
            reason = f"{NV_REQUIREMENT} is not cached and could not be downloaded: {exc}"
            if os.environ.get(REQUIRE_DOWNLOADS_ENV) == "1":
                pytest.fail(reason)
            pytest.skip(reason)
    assert sha256_file(path) == NV_WHEEL_SHA256
    return path


@pytest.fixture(scope="session", name="sample")
def sample_fixture(nv_wheel: Path) -> NvidiaSample:
    return read_sample(nv_wheel)


class RecordedNvml:
    """Answers NVML's CC calls with what an H100 answered once (NVIDIA's sample), in NVML's own structures."""

    def __init__(self, sample: NvidiaSample, *, cc: int = 1, devtools: int = 0, driver: str = "550.90.07",
                 vbios: str = "96.00.9F.00.01") -> None:
        self.sample, self.cc, self.devtools = sample, cc, devtools
        self.driver, self.vbios = driver, vbios  # what NVIDIA's verifier read from the sample's GPU

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetVbiosVersion(self, handle: int) -> str:
        return self.vbios

    def nvmlSystemGetConfComputeState(self) -> pynvml.c_nvmlConfComputeSystemState_t:
        return pynvml.c_nvmlConfComputeSystemState_t(environment=2, ccFeature=self.cc, devToolsMode=self.devtools)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetConfComputeGpuAttestationReport(self, handle: int, nonce: bytes) -> object:
        rep = pynvml.c_nvmlConfComputeGpuAttestationReport_t()
        raw = read_hex_or_raw(self.sample.report)  # recorded under SAMPLE_NONCE, whatever is asked now
        rep.attestationReportSize = len(raw)
        rep.attestationReport[:len(raw)] = list(raw)
        return rep

    def nvmlDeviceGetConfComputeGpuCertificate(self, handle: int) -> object:
        cert = pynvml.c_nvmlConfComputeGpuCertificate_t()
        cert.attestationCertChainSize = len(self.sample.chain)
        cert.attestationCertChain[:len(self.sample.chain)] = list(self.sample.chain)
        return cert
