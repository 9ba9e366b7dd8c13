"""SIM GPU evidence in NVIDIA's formats: SPDM 1.1 GET_MEASUREMENTS reports signed under a 5-level SIM chain shaped
like NVIDIA's (root -> identity -> provisioner ICA -> BROM -> FMC leaf with a DICE FWID), and driver/VBIOS RIMs
(swidtag XML) signed under a SIM RIM root.

The same verifier (:func:`.nvidia_gpu.verify_gpu`) checks SIM and real evidence; only the pinned roots differ (the
policy's ``device_root``/``rim_root``). Every SIM name carries "SIM": the roots' common names, the driver version
(``550.90.07-SIM``), the chip's model name, the RIMs' entity. Keys live in memory (or in the emulated platform's
state folder, never in the repository); SIM evidence never verifies under NVIDIA's roots.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID

from .nvidia_spdm import (
    GET_MEASUREMENTS,
    MEASUREMENTS,
    OPAQUE_CHIP_INFO,
    OPAQUE_DRIVER_VERSION,
    OPAQUE_FWID,
    OPAQUE_NVDEC0_STATUS,
    OPAQUE_VBIOS_VERSION,
    SPDM_VERSION_11,
)

__all__ = ["SIM_DRIVER_VERSION", "SIM_VBIOS_VERSION", "SimGpu", "SimGpuPki", "vbios_field"]

SIM_DRIVER_VERSION = "550.90.07-SIM"
SIM_VBIOS_VERSION = "96.00.99.00.01"
N_BLOCKS = 64
VBIOS_INDICES = range(0, 16)  # RIM indices the VBIOS RIM covers; the driver RIM covers the rest
NVDEC0_ENABLED = 0xAA
_SHA384_OID = bytes.fromhex("0609608648016503040202")
_DICE_OID = x509.ObjectIdentifier("2.23.133.5.4.1")
_NOT_BEFORE = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
_NOT_AFTER = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)  # as NVIDIA's device chain


def _tlv(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes([tag, n]) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + content


def dice_extension(public_key: ec.EllipticCurvePublicKey, fwid: bytes) -> bytes:
    """Hopper's leaf extension: SEQUENCE { INTEGER 1, SubjectPublicKeyInfo, FWID { sha384, digest } }."""
    spki = public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return _tlv(0x30, _tlv(0x02, b"\x01") + spki + _tlv(0x30, _SHA384_OID + _tlv(0x04, fwid)))


def vbios_field(version: str) -> bytes:
    """The 8-byte opaque VBIOS field NVIDIA's dotted form ``a.b.c.d.e`` is read from."""
    a, b, c, d, e = version.lower().split(".")
    return bytes.fromhex("000000" + e + a + b + c + d)[::-1]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gputravel (SIM)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey, *,
          ca: bool, extension: bytes | None = None) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                                            decipher_only=False), critical=True))
    if extension is not None:
        builder = builder.add_extension(x509.UnrecognizedExtension(_DICE_OID, extension), critical=False)
    return builder.sign(issuer_key, hashes.SHA384())


@dataclass(slots=True)
class SimGpuPki:
    """The SIM device chain (leaf first, root last) with the leaf's key, and the SIM RIM root and signer."""

    chain: list[x509.Certificate]
    leaf_key: ec.EllipticCurvePrivateKey
    rim_chain: list[x509.Certificate]  # signer, root
    rim_key: ec.EllipticCurvePrivateKey
    #: the keys of ``chain`` (leaf first), kept in memory by ``generate`` only (a SIM OCSP responder signs with
    #: them in tests); empty for a PKI loaded from the state folder
    chain_keys: list[ec.EllipticCurvePrivateKey] = field(default_factory=list)
    #: the keys of ``rim_chain`` (signer, root), in memory as ``chain_keys``
    rim_chain_keys: list[ec.EllipticCurvePrivateKey] = field(default_factory=list)

    @property
    def device_root(self) -> x509.Certificate:
        return self.chain[-1]

    @property
    def rim_root(self) -> x509.Certificate:
        return self.rim_chain[-1]

    @classmethod
    def generate(cls, fwid: bytes) -> SimGpuPki:
        names = ["gputravel SIM Device Identity CA", "SIM GH100 Identity", "SIM GH100 Provisioner ICA 1",
                 "GH100 A01 GSP BROM (SIM)", "GH100 A01 GSP FMC LF (SIM)"]
        keys = [ec.generate_private_key(ec.SECP384R1()) for _ in names]
        certs: list[x509.Certificate] = []
        for i, (cn, key) in enumerate(zip(names, keys, strict=True)):
            issuer = max(i - 1, 0)
            leaf = i == len(names) - 1
            certs.append(_cert(cn, key, names[issuer], keys[issuer], ca=not leaf,
                               extension=dice_extension(key.public_key(), fwid) if leaf else None))
        rim_root_key = ec.generate_private_key(ec.SECP384R1())
        rim_key = ec.generate_private_key(ec.SECP384R1())
        rim_root = _cert("gputravel SIM CoRIM signing Root CA", rim_root_key,
                         "gputravel SIM CoRIM signing Root CA", rim_root_key, ca=True)
        rim_signer = _cert("gputravel SIM RIM Signer", rim_key, "gputravel SIM CoRIM signing Root CA",
                           rim_root_key, ca=False)
        return cls(chain=certs[::-1], leaf_key=keys[-1], rim_chain=[rim_signer, rim_root], rim_key=rim_key,
                   chain_keys=keys[::-1], rim_chain_keys=[rim_key, rim_root_key])


def _sim_measurements(seed: bytes) -> list[bytes]:
    return [hashlib.sha384(b"gputravel SIM GPU measurement %d " % i + seed).digest() for i in range(N_BLOCKS)]


@dataclass(slots=True)
class SimGpu:
    """A SIM H100 that answers GET_MEASUREMENTS under the requester's nonce, signed with its leaf key."""

    pki: SimGpuPki
    fwid: bytes
    measurements: list[bytes] = field(default_factory=lambda: _sim_measurements(b""))
    driver_version: str = SIM_DRIVER_VERSION
    vbios_version: str = SIM_VBIOS_VERSION

    @classmethod
    def generate(cls, *, seed: bytes = b"") -> SimGpu:
        fwid = hashlib.sha384(b"gputravel SIM GSP FMC firmware" + seed).digest()
        return cls(pki=SimGpuPki.generate(fwid), fwid=fwid, measurements=_sim_measurements(seed))

    def cert_chain_pem(self) -> bytes:
        return b"".join(c.public_bytes(Encoding.PEM) for c in self.pki.chain)

    def _opaque(self) -> bytes:
        fields = [
            (OPAQUE_DRIVER_VERSION, self.driver_version.encode() + b"\0"),
            (OPAQUE_VBIOS_VERSION, vbios_field(self.vbios_version)),
            (OPAQUE_NVDEC0_STATUS, bytes([NVDEC0_ENABLED])),
            (OPAQUE_FWID, self.fwid),
            (OPAQUE_CHIP_INFO, b"GH100\0"),
        ]
        return b"".join(t.to_bytes(2, "little") + len(v).to_bytes(2, "little") + v for t, v in fields)

    def report(self, nonce: bytes) -> bytes:
        """Request (37 bytes, all 64 blocks, signature requested) + signed MEASUREMENTS response."""
        if len(nonce) != 32:
            raise ValueError(f"the SPDM nonce is 32 bytes, not {len(nonce)}")
        request = bytes([SPDM_VERSION_11, GET_MEASUREMENTS, 0x01, 0xFF]) + nonce + b"\x00"
        record = b"".join(bytes([i + 1, 1]) + (3 + len(v)).to_bytes(2, "little") + b"\x01"
                          + len(v).to_bytes(2, "little") + v for i, v in enumerate(self.measurements))
        opaque = self._opaque()
        response = (bytes([SPDM_VERSION_11, MEASUREMENTS, 0x00, 0x00, len(self.measurements)])
                    + len(record).to_bytes(3, "little") + record + os.urandom(32)
                    + len(opaque).to_bytes(2, "little") + opaque)
        der = self.pki.leaf_key.sign(request + response, ec.ECDSA(hashes.SHA384()))
        r, s = decode_dss_signature(der)
        return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")

    def rims(self) -> tuple[bytes, bytes]:
        """(driver RIM, VBIOS RIM), signed by the SIM RIM signer, with this GPU's measurements as golden values."""
        from .sim_rim import make_rim

        vbios = {i: [self.measurements[i]] for i in VBIOS_INDICES}
        driver = {i: [self.measurements[i]] for i in range(len(self.measurements)) if i not in vbios}
        return (make_rim(self.driver_version, driver, self.pki.rim_chain, self.pki.rim_key),
                make_rim(self.vbios_version.upper(), vbios, self.pki.rim_chain, self.pki.rim_key))
