"""SIM AMD SEV-SNP evidence: reports in AMD's format under a SIM ARK -> ASK -> VCEK, and Azure's form of them.

``SimSnp`` makes a SIM ARK and ASK (RSA, RSASSA-PSS SHA-384 salt 48, as AMD's) and a VCEK (ECDSA P-384) that
carries AMD's TCB and hwID extensions, and signs version-2 reports (ECDSA P-384 over bytes 0..0x29F, r and s
little-endian) over the caller's report data, measurement, host data, VMPL and debug bit. ``SimAzureVm`` wraps
one in Azure's HCL report (runtime data naming a SIM vTPM key ``HCLAkPub``) and makes TPM2 quotes by that key.
Every SIM name carries "SIM"; the issuer names keep the product ("SEV-Milan (SIM)"), so the verifier reads the
TCB layout from them. Checked by :mod:`.snp` and :mod:`.azure_snp` under the SIM roots (a policy naming the SIM
ARK and ASK files); SIM reports never verify under AMD's roots. The keys are made in memory per instance.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from .snp_report import REPORT_SIZE, SIGNED_SIZE, Tcb

__all__ = ["SimAzureVm", "SimSnp"]

PSS_SHA384 = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
OID_AMD = "1.3.6.1.4.1.3704.1."
SIM_RSA_BITS = 2048  # AMD's are 4096; the SIM's are smaller to be made quickly (the verifier reads any RSA size)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gputravel (SIM)")])


def _der_int(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")
    return bytes([0x02, len(body)]) + body


def _tcb_raw(tcb: Tcb, product: str) -> int:
    b = bytearray(8)
    if product == "turin":
        b[0], b[1], b[2], b[3], b[7] = tcb.fmc or 0, tcb.boot_loader, tcb.tee, tcb.snp, tcb.microcode
    else:
        b[0], b[1], b[6], b[7] = tcb.boot_loader, tcb.tee, tcb.snp, tcb.microcode
    return int.from_bytes(b, "little")


@dataclass(slots=True)
class SimSnp:
    """One SIM SEV-SNP chip: its ARK, ASK and VCEK (issued for ``tcb``), and reports signed by the VCEK."""

    product: str
    tcb: Tcb
    chip_id: bytes
    ark: x509.Certificate
    ask: x509.Certificate
    vcek: x509.Certificate
    vcek_key: ec.EllipticCurvePrivateKey
    #: the SIM ARK's key where this chip was made here (a test signs a CRL with it); not kept by ``sim_store``
    ark_key: rsa.RSAPrivateKey | None = None

    @classmethod
    def generate(cls, *, product: str = "milan", tcb: Tcb | None = None, chip_id: bytes | None = None) -> SimSnp:
        """A fresh SIM chip (RSA ARK and ASK, an ECDSA P-384 VCEK with AMD's extensions)."""
        tcb = tcb or Tcb(boot_loader=3, tee=0, snp=8, microcode=115)
        chip_id = chip_id or os.urandom(64)
        if product == "turin":
            chip_id = chip_id[:8] + bytes(56)
        title = product.capitalize()
        ark_key = rsa.generate_private_key(public_exponent=65537, key_size=SIM_RSA_BITS)
        ask_key = rsa.generate_private_key(public_exponent=65537, key_size=SIM_RSA_BITS)
        vcek_key = ec.generate_private_key(ec.SECP384R1())
        ark = cls._cert(f"ARK-{title} (SIM)", ark_key.public_key(), None, ark_key, ca=True)
        ask = cls._cert(f"SEV-{title} (SIM)", ask_key.public_key(), ark, ark_key, ca=True)
        exts = [(OID_AMD + "1", _der_int(1 if product == "turin" else 0)),
                (OID_AMD + "2", b"\x16" + bytes([len(title) + 3]) + f"{title}-B0".encode())]
        spl = {"3.1": tcb.boot_loader, "3.2": tcb.tee, "3.3": tcb.snp, "3.8": tcb.microcode}
        if product == "turin":
            spl["3.9"] = tcb.fmc or 0
        exts += [(OID_AMD + k, _der_int(v)) for k, v in spl.items()]
        exts.append((OID_AMD + "4", chip_id[:8] if product == "turin" else chip_id))
        vcek = cls._cert("SEV-VCEK", vcek_key.public_key(), ask, ask_key, ca=False, exts=exts)
        return cls(product=product, tcb=tcb, chip_id=chip_id, ark=ark, ask=ask, vcek=vcek, vcek_key=vcek_key,
                   ark_key=ark_key)

    @staticmethod
    def _cert(cn: str, public: rsa.RSAPublicKey | ec.EllipticCurvePublicKey, issuer: x509.Certificate | None,
              issuer_key: rsa.RSAPrivateKey, *, ca: bool, exts: list[tuple[str, bytes]] | None = None,
              ) -> x509.Certificate:
        start = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(cn))
                   .issuer_name(issuer.subject if issuer is not None else _name(cn)).public_key(public)
                   .serial_number(x509.random_serial_number()).not_valid_before(start)
                   .not_valid_after(start + dt.timedelta(days=365 * 25))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for oid, value in exts or []:
            builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA384(), rsa_padding=PSS_SHA384)

    def vcek_der(self) -> bytes:
        return self.vcek.public_bytes(Encoding.DER)

    def roots_pem(self) -> tuple[bytes, bytes]:
        """The SIM ARK and ASK, PEM (what a SIM policy pins as ``ark`` and ``ask``)."""
        return self.ark.public_bytes(Encoding.PEM), self.ask.public_bytes(Encoding.PEM)

    def report(self, report_data: bytes, *, measurement: bytes = b"\x5a" * 48, host_data: bytes = bytes(32),
               vmpl: int = 0, debug: bool = False, reported_tcb: Tcb | None = None, version: int = 2,
               smt: bool = True, migration_agent: bool = False) -> bytes:
        """A signed report (1,184 bytes) over ``report_data`` (at most 64 bytes, zero-padded). The guest policy has
        the reserved bit 17 set, and bit 16 (SMT allowed), 18 (migration agent) and 19 (debug) as asked."""
        if len(report_data) > 64 or len(measurement) != 48 or len(host_data) != 32:
            raise ValueError("report_data is at most 64 bytes, measurement 48, host_data 32")
        tcb = _tcb_raw(reported_tcb or self.tcb, self.product)
        body = bytearray(REPORT_SIZE)
        policy = 1 << 17 | smt << 16 | migration_agent << 18 | debug << 19
        struct.pack_into("<IIQ", body, 0, version, 1, policy)
        struct.pack_into("<IIQQI", body, 0x30, vmpl, 1, tcb, 1, 0)
        body[0x50:0x90] = report_data.ljust(64, b"\0")
        body[0x90:0xC0] = measurement
        body[0xC0:0xE0] = host_data
        body[0x140:0x160] = hashlib.sha256(report_data + os.urandom(16)).digest()
        struct.pack_into("<Q", body, 0x180, tcb)
        if version >= 3:
            body[0x188:0x18B] = {"milan": b"\x19\x01\x01", "genoa": b"\x19\x11\x01", "turin": b"\x1a\x02\x01"}[
                self.product]
        body[0x1A0:0x1E0] = self.chip_id
        struct.pack_into("<QQQ", body, 0x1E0, tcb, 0, tcb)
        r, s = decode_dss_signature(self.vcek_key.sign(bytes(body[:SIGNED_SIZE]), ec.ECDSA(hashes.SHA384())))
        body[0x2A0:0x2E8] = r.to_bytes(72, "little")
        body[0x2E8:0x330] = s.to_bytes(72, "little")
        return bytes(body)


@dataclass(slots=True)
class SimAzureVm:
    """A SIM Azure SNP CVM: a SIM chip's report in an HCL report whose runtime data names a SIM vTPM key."""

    chip: SimSnp
    ak: rsa.RSAPrivateKey

    @classmethod
    def generate(cls, chip: SimSnp | None = None) -> SimAzureVm:
        return cls(chip=chip or SimSnp.generate(), ak=rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def runtime_data(self, user_data: bytes = b"") -> bytes:
        nums = self.ak.public_key().public_numbers()

        def b64(v: int) -> str:
            return base64.urlsafe_b64encode(v.to_bytes((v.bit_length() + 7) // 8, "big")).rstrip(b"=").decode()

        doc = {"keys": [{"kid": "HCLAkPub", "key_ops": ["sign"], "kty": "RSA", "e": b64(nums.e), "n": b64(nums.n)}],
               "vm-configuration": {"secure-boot": True, "tpm-enabled": True, "sim": True},
               "user-data": user_data.hex().upper()}
        return json.dumps(doc, separators=(",", ":")).encode()

    def hcl_report(self, user_data: bytes = b"", *, debug: bool = False, vmpl: int = 0) -> bytes:
        """2,048 bytes as the vTPM's NV index holds them."""
        runtime = self.runtime_data(user_data)
        report = self.chip.report(hashlib.sha256(runtime).digest(), debug=debug, vmpl=vmpl)
        total = 32 + len(report) + 20 + len(runtime)
        head = struct.pack("<4sIIIII", b"HCLA", 1, total, 2, 0, 0).ljust(32, b"\0")
        rt = struct.pack("<5I", 20 + len(runtime), 1, 2, 1, len(runtime))
        return (head + report + rt + runtime).ljust(max(2048, total), b"\0")

    def quote(self, nonce: bytes, pcrs: tuple[bytes, ...] = tuple(bytes(32) for _ in range(24))) -> bytes:
        """A TPM2 quote by ``HCLAkPub`` over ``nonce`` (all 24 SHA-256 PCRs), serialised as azure-cvm-tooling does."""
        digest = hashlib.sha256(b"".join(pcrs)).digest()
        name = b"\x00\x0b" + hashlib.sha256(b"SIM AK").digest()
        attest = (struct.pack(">IH", 0xFF544347, 0x8018) + struct.pack(">H", len(name)) + name
                  + struct.pack(">H", len(nonce)) + nonce + bytes(17) + bytes(8)
                  + struct.pack(">IHB", 1, 0x000B, 3) + b"\xff\xff\xff" + struct.pack(">H", 32) + digest)
        sig = self.ak.sign(attest, padding.PKCS1v15(), hashes.SHA256())
        return (struct.pack("<Q", len(sig)) + sig + struct.pack("<Q", len(attest)) + attest
                + struct.pack("<Q", len(pcrs)) + b"".join(pcrs))
