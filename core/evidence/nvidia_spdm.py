"""NVIDIA GPU evidence: the SPDM 1.1 GET_MEASUREMENTS request and response, and the device certificate chain.

What a Hopper GPU in CC mode returns (``nvmlDeviceGetConfComputeGpuAttestationReport``) is the 37-byte request
the driver sent, then the response (DMTF DSP0274 1.1, offsets in bytes, integers little-endian)::

    request   0 version (0x11)  1 code (0xE0)  2 param1  3 param2  4..36 nonce (32)  36 slot id
    response  0 version  1 code (0x60)  2 param1  3 param2  4 number of blocks  5 record length L1 (3)
              8 measurement record (L1): blocks of index(1) spec(1, 1 = DMTF) size(2) then
                  DMTF value type(1) value size(2) value (SHA-384 digests, 48 bytes, on Hopper)
              8+L1 responder nonce (32)  40+L1 opaque length L2 (2)  42+L1 opaque data (L2): fields of
                  type(2) size(2) data; NVIDIA's types: 3 driver version, 6 VBIOS version, 20 FWID, ...
              42+L1+L2 signature: ECDSA P-384 r||s (96 bytes) over request || response-without-signature

and ``nvmlDeviceGetConfComputeGpuCertificate`` gives 5 PEM certificates, leaf first, up to "NVIDIA Device Identity
CA" (pinned: :func:`device_root`). The leaf carries the firmware's FWID in a TCG DICE TcbInfo extension; it must
equal the report's FWID field. This module imports only the standard library and ``cryptography`` (a holder
machine checks GPU evidence with it); RIM parsing (lxml, signxml) lives in :mod:`.nvidia_rim`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from .bounded import EvidenceTooLarge
from .bounded import read_hex_or_raw as bounded_hex_or_raw

__all__ = [
    "CHAIN_LENGTH",
    "EvidenceFormatError",
    "GpuReport",
    "MeasurementBlock",
    "check_chain",
    "device_root",
    "leaf_fwid",
    "load_pem_chain",
    "parse_report",
    "read_hex_or_raw",
]

REQUEST_LEN = 37
SIGNATURE_LEN = 96
CHAIN_LENGTH = 5
SPDM_VERSION_11 = 0x11
# SPDM 1.1 and 1.2 have the same GET_MEASUREMENTS layout; 1.3 adds an 8-byte RequesterContext at the end of the
# request, echoed in the response between the opaque data and the signature (DSP0274 1.3)
SPDM_VERSIONS = (0x11, 0x12, 0x13)
SPDM_VERSION_13 = 0x13
CONTEXT_LEN = 8
# the opaque field types NVIDIA's verifier (2.7.3, OpaqueData.OPAQUE_DATA_TYPES) knows; it refuses any other
OPAQUE_TYPES = frozenset([*range(1, 26), *range(32, 37), 255])
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
DMTF_SPEC = 1
OPAQUE_DRIVER_VERSION = 3
OPAQUE_VBIOS_VERSION = 6
OPAQUE_NVDEC0_STATUS = 11
OPAQUE_FWID = 20
OPAQUE_CHIP_INFO = 35
NVDEC0_DISABLED = 0x55
# TCG DICE TcbInfo (2.23.133.5.4.1) and its older arc, as NVIDIA's verifier accepts both
DICE_TCB_INFO_OIDS = ("2.23.133.5.4.1", "2.23.133.5.4.1.1")
CERTS_DIR = Path(__file__).resolve().parent / "certs"
# the architecture a chip's model name means ("GH100 A01 GSP BROM" -> Hopper, "GB100 ..." -> Blackwell)
ARCH_BY_CHIP_PREFIX = {"GH1": "HOPPER", "GB1": "BLACKWELL", "GB2": "BLACKWELL"}


class EvidenceFormatError(ValueError):
    """The bytes are not evidence of the expected shape (the claim ``...-report-parsed`` is false)."""


@dataclass(frozen=True, slots=True)
class MeasurementBlock:
    index: int  # SPDM block index, from 1; NVIDIA's RIMs number the same measurement index - 1
    value_type: int
    value: bytes


@dataclass(frozen=True, slots=True)
class GpuReport:
    """A parsed GET_MEASUREMENTS exchange; ``signed`` is the byte string the signature covers."""

    request: bytes
    response: bytes
    nonce: bytes  # the requester's nonce (request bytes 4..36)
    responder_nonce: bytes
    blocks: Mapping[int, MeasurementBlock]
    opaque: Mapping[int, bytes]
    signature: bytes
    signed: bytes

    @property
    def driver_version(self) -> str:
        return self.opaque.get(OPAQUE_DRIVER_VERSION, b"").split(b"\0", 1)[0].decode("ascii", "replace")

    @property
    def vbios_version(self) -> str:
        return format_vbios_version(self.opaque.get(OPAQUE_VBIOS_VERSION, b""))

    @property
    def fwid(self) -> bytes:
        return self.opaque.get(OPAQUE_FWID, b"")

    def measurement(self, rim_index: int) -> bytes | None:
        """The value NVIDIA's RIMs list under ``rim_index`` (SPDM block ``rim_index + 1``)."""
        block = self.blocks.get(rim_index + 1)
        return None if block is None else block.value


def read_hex_or_raw(data: bytes) -> bytes:
    """The raw bytes of evidence given either raw or as hex text (whitespace and a ``0x`` prefix allowed).

    Bounded (:mod:`.bounded`): over the cap it is refused before decoding.

    Raises:
        EvidenceFormatError: larger than :data:`.bounded.EVIDENCE_CAP`.
    """
    try:
        return bounded_hex_or_raw(data)
    except EvidenceTooLarge as exc:
        raise EvidenceFormatError(str(exc)) from None


def format_vbios_version(raw: bytes) -> str:
    """NVIDIA's dotted form of the 8-byte VBIOS field (``009f009601000000`` -> ``96.00.9f.00.01``)."""
    if len(raw) != 8:
        return ""
    le = raw[::-1].hex()  # the field read as one little-endian integer, as NVIDIA's verifier does
    digits = le[8:] + le[6:8]
    return ".".join(digits[i:i + 2] for i in range(0, len(digits), 2))


def _u(data: bytes, start: int, size: int) -> int:
    if start + size > len(data):
        raise EvidenceFormatError(f"truncated at byte {start} (need {size} more, have {len(data) - start})")
    return int.from_bytes(data[start:start + size], "little")


def parse_report(raw: bytes) -> GpuReport:
    """Parse request (37 bytes) + response; every length is checked against the bytes present.

    Versions 1.1, 1.2 (same layout) and 1.3 (the RequesterContext) are read; request and response must agree.

    Raises:
        EvidenceFormatError: wrong codes or version, a length that overruns, trailing bytes, a non-DMTF block, an
            opaque field of a type NVIDIA does not define.
    """
    version = raw[0] if raw else 0
    req_len = REQUEST_LEN + (CONTEXT_LEN if version == SPDM_VERSION_13 else 0)
    if len(raw) < req_len + 42 + SIGNATURE_LEN:
        raise EvidenceFormatError(f"{len(raw)} bytes is too short for a GET_MEASUREMENTS request and response")
    req, resp = raw[:req_len], raw[req_len:]
    if req[0] not in SPDM_VERSIONS or req[1] != GET_MEASUREMENTS:
        raise EvidenceFormatError(f"request is not SPDM 1.1/1.2/1.3 GET_MEASUREMENTS (version 0x{req[0]:02x}, "
                                  f"code 0x{req[1]:02x})")
    if resp[0] != req[0] or resp[1] != MEASUREMENTS:
        raise EvidenceFormatError(f"response is not an SPDM {req[0] >> 4}.{req[0] & 15} MEASUREMENTS (version "
                                  f"0x{resp[0]:02x}, code 0x{resp[1]:02x})")
    n_blocks = resp[4]
    rec_len = _u(resp, 5, 3)
    record = resp[8:8 + rec_len]
    if len(record) != rec_len:
        raise EvidenceFormatError(f"measurement record says {rec_len} bytes, {len(record)} present")
    blocks: dict[int, MeasurementBlock] = {}
    i = 0
    while i < rec_len:
        index, spec, size = record[i], _u(record, i + 1, 1), _u(record, i + 2, 2)
        if spec != DMTF_SPEC:
            raise EvidenceFormatError(f"measurement block {index} is not in DMTF format (spec {spec})")
        body = record[i + 4:i + 4 + size]
        if len(body) != size or size < 3:
            raise EvidenceFormatError(f"measurement block {index} overruns the record")
        vtype, vsize = body[0], _u(body, 1, 2)
        if vsize != size - 3:
            raise EvidenceFormatError(f"measurement block {index}: value size {vsize} != block size {size} - 3")
        if index in blocks:
            raise EvidenceFormatError(f"measurement block {index} appears twice")
        blocks[index] = MeasurementBlock(index, vtype, bytes(body[3:]))
        i += 4 + size
    if len(blocks) != n_blocks:
        raise EvidenceFormatError(f"response says {n_blocks} measurement blocks, the record holds {len(blocks)}")
    pos = 8 + rec_len
    responder_nonce = resp[pos:pos + 32]
    opaque_len = _u(resp, pos + 32, 2)
    pos += 34
    opaque_raw = resp[pos:pos + opaque_len]
    if len(opaque_raw) != opaque_len:
        raise EvidenceFormatError(f"opaque data says {opaque_len} bytes, {len(opaque_raw)} present")
    pos += opaque_len
    if version == SPDM_VERSION_13:
        if resp[pos:pos + CONTEXT_LEN] != req[REQUEST_LEN:]:
            raise EvidenceFormatError("the response's RequesterContext is not the request's (SPDM 1.3)")
        pos += CONTEXT_LEN
    if len(resp) - pos != SIGNATURE_LEN:
        raise EvidenceFormatError(f"{len(resp) - pos} bytes follow the opaque data; the signature is "
                                  f"{SIGNATURE_LEN}")
    opaque: dict[int, bytes] = {}
    j = 0
    while j < opaque_len:
        ftype, fsize = _u(opaque_raw, j, 2), _u(opaque_raw, j + 2, 2)
        value = opaque_raw[j + 4:j + 4 + fsize]
        if len(value) != fsize:
            raise EvidenceFormatError(f"opaque field {ftype} overruns the opaque data")
        if ftype not in OPAQUE_TYPES:
            raise EvidenceFormatError(f"opaque field of unknown type {ftype} (NVIDIA's verifier refuses it too)")
        opaque[ftype] = bytes(value)
        j += 4 + fsize
    return GpuReport(
        request=bytes(req), response=bytes(resp), nonce=bytes(req[4:36]), responder_nonce=bytes(responder_nonce),
        blocks=blocks, opaque=opaque, signature=bytes(resp[pos:]), signed=bytes(raw[:len(raw) - SIGNATURE_LEN]),
    )


# --- certificates ----------------------------------------------------------------------------------------------
def load_pem_chain(data: bytes) -> list[x509.Certificate]:
    """Certificates of a PEM bundle (or hex text of one), in file order.

    Raises:
        EvidenceFormatError: no certificate, or one that does not parse.
    """
    data = read_hex_or_raw(data)
    pems = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", data, re.S)
    if not pems:
        raise EvidenceFormatError("no PEM certificate in the certificate chain")
    try:
        return [x509.load_pem_x509_certificate(p) for p in pems]
    except ValueError as exc:
        raise EvidenceFormatError(f"a certificate of the chain does not parse: {exc}") from exc


def device_root() -> x509.Certificate:
    """NVIDIA's Device Identity CA as NVIDIA's verifier pins it (shipped in ``certs/``)."""
    return x509.load_pem_x509_certificate((CERTS_DIR / "nvidia_device_identity_ca.crt").read_bytes())


def check_chain(chain: Sequence[x509.Certificate], root: x509.Certificate, *, at: dt.datetime,
                length: int | None = CHAIN_LENGTH) -> str | None:
    """``None`` if ``chain`` (leaf first) ends in ``root`` and each certificate is issued by the next and valid
    at ``at``; otherwise the reason. The chain's own top certificate must be the pinned root itself."""
    if length is not None and len(chain) != length:
        return f"{len(chain)} certificates, expected {length}"
    if not chain:
        return "no certificates"
    if chain[-1] != root:
        return (f"the top certificate ({chain[-1].subject.rfc4514_string()}) is not the pinned root "
                f"({root.subject.rfc4514_string()})")
    for pos, cert in enumerate(chain):
        if not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
            return (f"certificate {pos} ({cert.subject.rfc4514_string()}) is not valid at {at.isoformat()} "
                    f"(valid {cert.not_valid_before_utc.isoformat()} to {cert.not_valid_after_utc.isoformat()})")
        issuer = chain[pos + 1] if pos + 1 < len(chain) else root
        if pos + 1 < len(chain) or cert == root:
            try:
                bc = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
            except x509.ExtensionNotFound:
                bc = None
            if bc is None or not bc.ca:
                return f"certificate {pos + 1} ({issuer.subject.rfc4514_string()}) is not a CA"
            try:
                ku = issuer.extensions.get_extension_for_class(x509.KeyUsage).value
            except x509.ExtensionNotFound:
                ku = None
            if ku is not None and not ku.key_cert_sign:
                return f"certificate {pos + 1} ({issuer.subject.rfc4514_string()}) may not sign certificates"
        try:
            cert.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature) as exc:
            return (f"certificate {pos} ({cert.subject.rfc4514_string()}) is not signed by "
                    f"{issuer.subject.rfc4514_string()}: {exc or 'bad signature'}")
    return None


def _der(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of contents) of the DER element at ``pos``."""
    if pos + 2 > len(data):
        raise EvidenceFormatError("DER element truncated")
    tag, first = data[pos], data[pos + 1]
    pos += 2
    if first & 0x80:
        n = first & 0x7F
        if n == 0 or n > 4 or pos + n > len(data):
            raise EvidenceFormatError("bad DER length")
        length = int.from_bytes(data[pos:pos + n], "big")
        pos += n
    else:
        length = first
    if pos + length > len(data):
        raise EvidenceFormatError("DER element overruns its container")
    return tag, pos, pos + length


def _find_fwid(raw: bytes, start: int, end: int) -> bytes | None:
    """Depth-first: the digest of the first SEQUENCE { OID, OCTET STRING } among constructed elements."""
    pos = start
    while pos < end:
        tag, cstart, cend = _der(raw, pos)
        if tag == 0x30:
            t1, _, e1 = _der(raw, cstart) if cstart < cend else (0, 0, cend)
            if t1 == 0x06 and e1 < cend:
                t2, s2, e2 = _der(raw, e1)
                if t2 == 0x04 and e2 == cend:
                    return raw[s2:e2]
        if tag == 0x30 or 0xA0 <= tag <= 0xAF:
            found = _find_fwid(raw, cstart, cend)
            if found is not None:
                return found
        pos = cend
    return None


def leaf_fwid(cert: x509.Certificate) -> bytes | None:
    """The first FWID digest in the certificate's TCG DICE extension (``None`` if it has none).

    Hopper's leaf carries SEQUENCE { INTEGER, SubjectPublicKeyInfo, FWID }, the DICE TcbInfo form puts FWIDs under
    ``fwids [6]``; both hold FWID ::= SEQUENCE { hashAlg OID, digest OCTET STRING }, which is what is searched for.
    """
    for ext in cert.extensions:
        if ext.oid.dotted_string not in DICE_TCB_INFO_OIDS:
            continue
        raw = ext.value.value if isinstance(ext.value, x509.UnrecognizedExtension) else b""
        return _find_fwid(raw, 0, len(raw))
    return None


def hwmodel_of(chain: Sequence[x509.Certificate]) -> str:
    """NVIDIA's ``hwmodel``: the common name of the certificate above the leaf (e.g. "GH100 A01 GSP BROM")."""
    if len(chain) < 2:
        return ""
    names = chain[1].subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def signature_ok(report: GpuReport, leaf: x509.Certificate) -> bool:
    key = leaf.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        return False
    half = SIGNATURE_LEN // 2
    der = encode_dss_signature(int.from_bytes(report.signature[:half], "big"),
                               int.from_bytes(report.signature[half:], "big"))
    try:
        key.verify(der, report.signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return False
    return True
