"""SIM TDX evidence: version-4 quotes under a SIM PCK chain, with SIM collateral (TCB info, QE identity, CRLs) that
dcap-qvl verifies with ``verify_with_root_ca`` and the SIM root.

Built on a real quote and its collateral (``sim_template/``, from dcap-qvl, MIT): their structure is kept (the PCK
certificate's SGX extension and FMSPC, the QE report, the TCB info and QE identity), every signature is made anew
with SIM keys: a SIM root and PCK platform CA sign the PCK certificate and the CRLs, the PCK key signs the QE
report, a fresh attestation key (bound into the QE report's data) signs the quote, a SIM TCB signing key signs the
TCB info and QE identity (with fresh issue and next-update dates). All SIM names carry "SIM". The TD report's MRTD,
RTMRs, attributes and report data are the caller's; SIM quotes never verify under Intel's root.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID

__all__ = ["SGX_EXTENSION_OID", "SimTdx", "SimTdxPki"]

TEMPLATE_DIR = Path(__file__).resolve().parent / "sim_template"
SGX_EXTENSION_OID = x509.ObjectIdentifier("1.2.840.113741.1.13.1")
HEADER_LEN = 48
BODY_LEN = 584  # TD report 1.0
QE_REPORT_LEN = 384
QE_REPORT_DATA = 320
BODY_TD_ATTRIBUTES = 120
BODY_MR_TD = 136
BODY_RTMR0 = 328
BODY_REPORT_DATA = 520
CERT_TYPE_QE_REPORT = 6
CERT_TYPE_PCK_CHAIN = 5


def _raw_sig(key: ec.EllipticCurvePrivateKey, data: bytes, *, deterministic: bool = False) -> bytes:
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256(), deterministic_signing=deterministic)))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gputravel (SIM)"),
                      x509.NameAttribute(NameOID.COUNTRY_NAME, "US")])


def _cert(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, path_length: int | None = None,
          extra: x509.UnrecognizedExtension | None = None) -> x509.Certificate:
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    issuer_name = issuer.subject if issuer is not None else _name(cn)
    issuer_pub = (issuer.public_key() if issuer is not None else key.public_key())
    assert isinstance(issuer_pub, ec.EllipticCurvePublicKey)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now)
         .not_valid_after(now + dt.timedelta(days=365 * 25))
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_pub), critical=False)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
         .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=not ca, key_encipherment=False,
                                      data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                                      encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=path_length if ca else None), critical=True))
    if extra is not None:
        b = b.add_extension(extra, critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pems(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(Encoding.PEM).decode() for c in certs)


@dataclass(slots=True)
class SimTdxPki:
    """SIM root -> SIM PCK platform CA -> SIM PCK certificate (with the template's SGX extension); SIM root -> SIM
    TCB signing certificate. ECDSA P-256, as Intel's."""

    root: x509.Certificate
    root_key: ec.EllipticCurvePrivateKey
    pck_ca: x509.Certificate
    pck_ca_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    tcb_signer: x509.Certificate
    tcb_key: ec.EllipticCurvePrivateKey

    @property
    def root_der(self) -> bytes:
        return self.root.public_bytes(Encoding.DER)

    @classmethod
    def generate(cls, sgx_extension: bytes) -> SimTdxPki:
        keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(4)]
        root = _cert("gputravel SIM SGX Root CA", keys[0], None, keys[0], ca=True, path_length=1)
        pck_ca = _cert("gputravel SIM SGX PCK Platform CA", keys[1], root, keys[0], ca=True, path_length=0)
        pck = _cert("gputravel SIM SGX PCK Certificate", keys[2], pck_ca, keys[1], ca=False,
                    extra=x509.UnrecognizedExtension(SGX_EXTENSION_OID, sgx_extension))
        tcb = _cert("gputravel SIM SGX TCB Signing", keys[3], root, keys[0], ca=False)
        return cls(root, keys[0], pck_ca, keys[1], pck, keys[2], tcb, keys[3])


def _template_pck_extension(quote: bytes) -> bytes:
    pems = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", quote, re.S)
    leaf = x509.load_pem_x509_certificate(pems[0])
    ext = leaf.extensions.get_extension_for_oid(SGX_EXTENSION_OID).value
    assert isinstance(ext, x509.UnrecognizedExtension)
    return ext.value


@dataclass(slots=True)
class SimTdx:
    """A SIM TDX guest: makes quotes over caller-chosen TD measurements, and the collateral to verify them."""

    pki: SimTdxPki
    template_quote: bytes
    template_collateral: dict[str, str]
    attestation_key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

    @classmethod
    def generate(cls) -> SimTdx:
        quote = (TEMPLATE_DIR / "tdx_quote").read_bytes()
        collateral = json.loads((TEMPLATE_DIR / "tdx_quote_collateral.json").read_text())
        return cls(pki=SimTdxPki.generate(_template_pck_extension(quote)), template_quote=quote,
                   template_collateral=collateral)

    @property
    def mr_td(self) -> bytes:
        """The template TD's MRTD (the SIM CVM image's measurement unless ``quote(mr_td=...)`` says otherwise)."""
        return self.template_quote[HEADER_LEN + BODY_MR_TD:HEADER_LEN + BODY_MR_TD + 48]

    def quote(self, report_data: bytes, *, mr_td: bytes | None = None, rtmrs: list[bytes] | None = None,
              debug: bool = False) -> bytes:
        """A version-4 quote whose TD report binds ``report_data`` (64 bytes), signed under the SIM PCK chain."""
        if len(report_data) != 64:
            raise ValueError(f"TDX report data is 64 bytes, not {len(report_data)}")
        header = self.template_quote[:HEADER_LEN]
        body = bytearray(self.template_quote[HEADER_LEN:HEADER_LEN + BODY_LEN])
        body[BODY_REPORT_DATA:BODY_REPORT_DATA + 64] = report_data
        if mr_td is not None:
            body[BODY_MR_TD:BODY_MR_TD + 48] = mr_td
        for i, value in enumerate(rtmrs or []):
            body[BODY_RTMR0 + 48 * i:BODY_RTMR0 + 48 * (i + 1)] = value
        body[BODY_TD_ATTRIBUTES] = (body[BODY_TD_ATTRIBUTES] & 0xFE) | int(debug)
        signature = _raw_sig(self.attestation_key, header + bytes(body))
        att_pub, qe_cert = self._qe_certification()
        signed = signature + att_pub + struct.pack("<HI", CERT_TYPE_QE_REPORT, len(qe_cert)) + qe_cert
        return header + bytes(body) + struct.pack("<I", len(signed)) + signed

    def _qe_certification(self) -> tuple[bytes, bytes]:
        """(attestation key, QE certification data): the QE report binding that key, its PCK signature, the QE
        authentication data and the PCK chain. As a real platform's QE certifies its attestation key once and
        puts the same data in every quote, these are the same bytes in every quote of this platform (its QE
        report signed deterministically, RFC 6979), in any process that loads its folder."""
        att_pub = self.attestation_key.public_key().public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)[1:]
        # the template's QE report and QE authentication data, re-bound to this attestation key
        sig_data = self.template_quote[HEADER_LEN + BODY_LEN + 4:]
        cert = sig_data[128 + 6:]
        qe_report = bytearray(cert[:QE_REPORT_LEN])
        auth_len = struct.unpack_from("<H", cert, QE_REPORT_LEN + 64)[0]
        qe_auth = cert[QE_REPORT_LEN + 66:QE_REPORT_LEN + 66 + auth_len]
        qe_report[QE_REPORT_DATA:QE_REPORT_DATA + 64] = hashlib.sha256(att_pub + qe_auth).digest() + bytes(32)
        chain = _pems(self.pki.pck, self.pki.pck_ca, self.pki.root).encode()
        inner = struct.pack("<HI", CERT_TYPE_PCK_CHAIN, len(chain)) + chain
        qe_sig = _raw_sig(self.pki.pck_key, bytes(qe_report), deterministic=True)
        return att_pub, bytes(qe_report) + qe_sig + struct.pack("<H", auth_len) + qe_auth + inner

    def collateral(self, *, issued: dt.datetime, valid_days: int = 30) -> str:
        """SIM collateral (dcap-qvl's QuoteCollateralV3 JSON) issued at ``issued``, valid ``valid_days``: signed
        deterministically (RFC 6979), so one platform's collateral of one ``issued`` is the same bytes in every
        process, as Intel's PCS serves the same collateral to every guest of a platform."""
        until = issued + dt.timedelta(days=valid_days)
        stamp = {"issueDate": issued.strftime("%Y-%m-%dT%H:%M:%SZ"), "nextUpdate": until.strftime("%Y-%m-%dT%H:%M:%SZ")}
        signed: dict[str, str] = {}
        for key in ("tcb_info", "qe_identity"):
            doc = json.loads(self.template_collateral[key])
            doc.update(stamp)
            text = json.dumps(doc, separators=(",", ":"))
            signed[key] = text
            signed[f"{key}_signature"] = _raw_sig(self.pki.tcb_key, text.encode(), deterministic=True).hex()
        tcb_chain = _pems(self.pki.tcb_signer, self.pki.root)
        return json.dumps({
            "pck_crl_issuer_chain": _pems(self.pki.pck_ca, self.pki.root),
            "root_ca_crl": self._crl(self.pki.root, self.pki.root_key, issued, until).hex(),
            "pck_crl": self._crl(self.pki.pck_ca, self.pki.pck_ca_key, issued, until).hex(),
            "tcb_info_issuer_chain": tcb_chain,
            "tcb_info": signed["tcb_info"],
            "tcb_info_signature": signed["tcb_info_signature"],
            "qe_identity_issuer_chain": tcb_chain,
            "qe_identity": signed["qe_identity"],
            "qe_identity_signature": signed["qe_identity_signature"],
        })

    @staticmethod
    def _crl(issuer: x509.Certificate, key: ec.EllipticCurvePrivateKey, issued: dt.datetime,
             until: dt.datetime) -> bytes:
        issuer_pub = issuer.public_key()
        assert isinstance(issuer_pub, ec.EllipticCurvePublicKey)
        crl = (x509.CertificateRevocationListBuilder().issuer_name(issuer.subject).last_update(issued)
               .next_update(until).add_extension(x509.CRLNumber(1), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_pub), critical=False)
               .sign(key, hashes.SHA256(), ecdsa_deterministic=True))
        return crl.public_bytes(Encoding.DER)
