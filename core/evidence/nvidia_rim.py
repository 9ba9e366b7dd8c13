"""NVIDIA reference-integrity manifests (RIMs): signed swidtag XML with the golden measurements of a driver or VBIOS.

A RIM is an ISO/IEC 19770-2 SoftwareIdentity tag: ``Meta/@colloquialVersion`` names the driver ("550.90.07") or
VBIOS ("96.00.9F.00.01") it describes, ``Payload/Resource`` elements carry one measurement each (``index`` from 0,
``active``, ``alternatives`` and ``Hash0..HashN-1`` in the SHA-384 namespace), and an enveloped XML signature
(``ds:Signature``) carries the signer's certificates, leaf first, up to "NVIDIA CoRIM signing Root CA" (pinned:
:func:`rim_root`).

Checks, each a claim named as NVIDIA's verifier names it (``x-nvidia-gpu-driver-rim-*`` or
``x-nvidia-gpu-vbios-rim-*``): schema (the shipped XSDs), certificate chain to the pinned root at the verification
time (its own top certificate must be the pinned root; at least NVIDIA's four levels under NVIDIA's root), XML
signature (signxml, with the chain's leaf, only when that leaf chains to the pinned root), version match with the report, measurements present. The
golden values are read from what the signature covers (signxml's ``signed_xml``), never from the raw tree.
Revocation (OCSP) is not checked offline; a claim says so.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from lxml import etree
from signxml import InvalidInput, InvalidSignature, SignatureConfiguration, XMLVerifier  # type: ignore[attr-defined]

from .bounded import EVIDENCE_CAP
from .claims import ClaimSet
from .nvidia_spdm import CERTS_DIR, check_chain
from .spdm_claims import add_cert_chain_claim

__all__ = ["NVIDIA_RIM_LEVELS", "Rim", "rim_certificates", "rim_chain_problem", "rim_kind", "rim_root", "rim_version", "verify_rim"]

SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
SWID_NS = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
DSIG_NS = "http://www.w3.org/2000/09/xmldsig#"
SHA384_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
TCG_RIM_NS = "https://trustedcomputinggroup.org/resource/tcg-reference-integrity-manifest-rim-information-model/"
# NVIDIA's RIM chains: "HCC RIM L4 Signer" <- "NVIDIA Reference Value L3 GH100 001" <- "NVIDIA Reference Value
# GH100 CA" <- "NVIDIA CoRIM signing Root CA" (the wheel's sample RIMs)
NVIDIA_RIM_LEVELS = 4
_VBIOS_VERSION = re.compile(r"^[0-9a-f]{2}(\.[0-9a-f]{2}){4}$", re.I)
_schema: etree.XMLSchema | None = None


@dataclass(slots=True)
class Rim:
    """What one RIM says, once checked: its kind, version and active golden measurements (index -> values)."""

    kind: str  # "driver" or "vbios"
    version: str
    golden: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
    ok: bool = False
    manufacturer_id: str | None = None  # Meta/@rim:FirmwareManufacturerId: NVIDIA's ``oemid`` (driver RIM)


def rim_root() -> x509.Certificate:
    """NVIDIA's RIM signing root as NVIDIA's verifier pins it (shipped in ``certs/``)."""
    return x509.load_pem_x509_certificate((CERTS_DIR / "nvidia_rim_root.crt").read_bytes())


def _swid_schema() -> etree.XMLSchema:
    global _schema
    if _schema is None:
        parser = etree.XMLParser(resolve_entities=False, no_network=True)
        _schema = etree.XMLSchema(etree.parse(str(SCHEMA_DIR / "swidSchema2015.xsd"), parser))
    return _schema


def rim_kind(version: str) -> str:
    """``vbios`` for a five-part hex version (96.00.9F.00.01), else ``driver``."""
    return "vbios" if _VBIOS_VERSION.match(version) else "driver"


def rim_version(data: bytes) -> str:
    """The ``colloquialVersion`` a RIM claims (unverified: to pick the report version to compare with)."""
    try:
        return _version(_parse(data))
    except (etree.XMLSyntaxError, ValueError):
        return ""


def _parse(data: bytes) -> Any:
    parser = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False)
    return etree.fromstring(data, parser)


def _version(root: Any) -> str:
    meta = root.find(f"{{{SWID_NS}}}Meta")
    return str(meta.get("colloquialVersion", "")) if meta is not None else ""


def rim_certificates(data: bytes) -> list[x509.Certificate]:
    """The certificates a RIM's signature carries, leaf first (unverified; [] when unreadable)."""
    try:
        return _certificates(_parse(data))
    except (etree.XMLSyntaxError, ValueError):
        return []


def _certificates(root: Any) -> list[x509.Certificate]:
    return [x509.load_der_x509_certificate(base64.b64decode("".join((el.text or "").split())))
            for el in root.iter(f"{{{DSIG_NS}}}X509Certificate")]


def _golden(root: Any) -> dict[int, tuple[bytes, ...]]:
    payload = root.find(f"{{{SWID_NS}}}Payload")
    if payload is None:
        raise ValueError("no Payload")
    golden: dict[int, tuple[bytes, ...]] = {}
    seen: set[int] = set()
    for res in payload.iter(f"{{{SWID_NS}}}Resource"):
        index = int(res.get("index"))
        if index in seen:
            raise ValueError(f"index {index} appears twice")
        seen.add(index)
        if res.get("active") == "False":
            continue
        n = int(res.get("alternatives", "1"))
        size = int(res.get("size", "48"))
        values = tuple(bytes.fromhex(res.get(f"{{{SHA384_NS}}}Hash{i}")) for i in range(n))
        if any(len(v) != size for v in values):
            raise ValueError(f"index {index}: a value is not {size} bytes")
        golden[index] = values
    return golden


def rim_chain_problem(certs: list[x509.Certificate], pinned: x509.Certificate, *, at: dt.datetime) -> str | None:
    """Why a RIM's own chain (leaf first) is not acceptable, or None.

    The chain must end in the pinned root itself (byte-equal; NVIDIA's verifier appends the root instead, so a
    chain whose own top is another certificate still passes there if that one is signed by the root), each
    certificate signed by the next and valid at ``at``; under NVIDIA's root at least NVIDIA's levels (signer, L3,
    CA, root: :data:`NVIDIA_RIM_LEVELS`), under another pinned root (SIM, tests) a signer and the root.
    """
    levels = NVIDIA_RIM_LEVELS if pinned == rim_root() else 2
    if len(certs) < levels:
        return (f"{len(certs)} certificate(s) in the RIM's chain; it needs at least {levels} (signer ... pinned root)"
                + ("" if levels == 2 else ", as NVIDIA's RIMs carry"))
    return check_chain(certs, pinned, at=at, length=None)


def verify_rim(data: bytes, *, expected_version: str, kind: str | None = None, root: x509.Certificate | None = None,
               at: dt.datetime | None = None, claims: ClaimSet | None = None) -> tuple[ClaimSet, Rim | None]:
    """Check one RIM against the version the report names; claims are added under the RIM's kind.

    Returns the claims and, when the schema, chain and signature hold, the RIM (``ok`` only if the version
    matches too); never raises on bad input.
    """
    out = claims if claims is not None else ClaimSet()
    at = at or dt.datetime.now(dt.UTC)
    try:
        if len(data) > EVIDENCE_CAP:
            raise ValueError(f"{len(data):,} bytes, over the {EVIDENCE_CAP:,}-byte evidence cap")
        tree = _parse(data)
        version = _version(tree)
    except (etree.XMLSyntaxError, ValueError) as exc:
        p = f"x-nvidia-gpu-{kind or 'driver'}-rim"
        out.add(f"{p}-fetched", False, False, f"not XML: {exc}")
        return out, None
    kind = kind or rim_kind(version)
    p = f"x-nvidia-gpu-{kind}-rim"
    out.add(f"{p}-fetched", True, True, f"version {version or '?'} (from a file, offline)")
    schema_ok = bool(_swid_schema().validate(tree))
    out.add(f"{p}-schema-validated", schema_ok, schema_ok,
            "" if schema_ok else str(_swid_schema().error_log.last_error))
    why: str | None
    pinned = root or rim_root()
    try:
        certs = _certificates(tree)
    except ValueError as exc:
        certs, why = [], f"a certificate does not parse: {exc}"
    else:
        why = rim_chain_problem(certs, pinned, at=at)
    add_cert_chain_claim(out, f"{p}-cert-chain", certs, why, at=at)
    signed = None
    if certs:
        leaf = certs[0]
        # the signature itself is checked at a time the leaf was valid; whether it is valid now is the chain claim
        when = at if leaf.not_valid_before_utc <= at <= leaf.not_valid_after_utc else leaf.not_valid_before_utc
        # as NVIDIA's verifier (signxml with the RIM root as CA): the signing certificate must chain to the pinned
        # root, else the signature proves nothing (a self-made certificate signs anything)
        sig_why = rim_chain_problem(certs, pinned, at=when) or ""
        try:
            if sig_why:
                raise InvalidInput(f"the signing certificate does not chain to the pinned root: {sig_why}")
            result = XMLVerifier().verify(
                data, x509_cert=leaf.public_bytes(Encoding.PEM).decode(),
                expect_config=SignatureConfiguration(verification_time=when))
            if isinstance(result, list):  # one Reference is expected (the default): a list never comes back
                raise InvalidInput("more than one signed reference")
            signed = result.signed_xml
        except (InvalidSignature, InvalidInput, ValueError) as exc:
            sig_why = str(exc)
        else:
            sig_why = ""
    else:
        sig_why = "no signing certificate"
    out.add(f"{p}-signature-verified", signed is not None, signed is not None, sig_why or "XML signature (signxml)")
    version_ok = bool(expected_version) and version.lower() == expected_version.lower()
    out.add(f"{p}-version-match", version_ok, version_ok, f"RIM {version or '?'}, report {expected_version or '?'}")
    golden: dict[int, tuple[bytes, ...]] = {}
    if signed is not None:
        try:
            golden = _golden(signed)
        except (ValueError, TypeError) as exc:
            out.add(f"{p}-measurements-available", False, False, str(exc))
            return out, None
    available = bool(golden)
    out.add(f"{p}-measurements-available", available, available,
            f"{len(golden)} active measurements" if available else "no signed measurements")
    if signed is None or not schema_ok or why is not None:
        return out, None
    meta = signed.find(f"{{{SWID_NS}}}Meta")
    oemid = meta.get(f"{{{TCG_RIM_NS}}}FirmwareManufacturerId") if meta is not None else None
    return out, Rim(kind=kind, version=version, golden=golden, ok=version_ok and available,
                    manufacturer_id=str(oemid) if oemid is not None else None)
