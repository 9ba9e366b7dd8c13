"""SIM RIMs: schema-valid ISO/IEC 19770-2 swidtags with golden measurements, signed (enveloped XML signature,
ECDSA P-384/SHA-384, signxml) by a SIM RIM signer whose chain rides in the signature's X509Data, as NVIDIA's do."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from lxml import etree
from signxml import SignatureMethod, XMLSigner  # type: ignore[attr-defined]

from .nvidia_rim import SHA384_NS, SWID_NS

__all__ = ["make_rim"]


def make_rim(version: str, golden: Mapping[int, Sequence[bytes]], chain: Sequence[x509.Certificate],
             key: ec.EllipticCurvePrivateKey, *, size: int = 48) -> bytes:
    """A SIM RIM for ``version`` listing ``golden`` (index -> allowed values; the other indices inactive)."""
    nsmap = {None: SWID_NS, "SHA384": SHA384_NS}
    tag_id = hashlib.sha384(f"gputravel SIM RIM {version}".encode()).hexdigest()
    root = etree.Element(f"{{{SWID_NS}}}SoftwareIdentity", nsmap=nsmap, attrib={
        "corpus": "false", "name": "GH100 (SIM)", "patch": "false", "supplemental": "false", "tagId": tag_id,
        "version": "1.0", "tagVersion": "0"})
    etree.SubElement(root, f"{{{SWID_NS}}}Entity", attrib={
        "name": "gputravel (SIM)", "regid": "gputravel.invalid", "role": "softwareCreator tagCreator"})
    etree.SubElement(root, f"{{{SWID_NS}}}Meta", attrib={
        "colloquialVersion": version, "edition": "GPU", "product": "GH100", "revision": "SIM"})
    payload = etree.SubElement(root, f"{{{SWID_NS}}}Payload")
    last = max(golden, default=-1)
    for index in range(last + 1):
        values = list(golden.get(index, ()))
        attrib = {"type": "Measurement", "index": str(index), "active": "True" if values else "False",
                  "alternatives": str(max(len(values), 1)), "name": f"Measurement_{index}", "size": str(size)}
        for i, v in enumerate(values or [bytes(size)]):
            attrib[f"{{{SHA384_NS}}}Hash{i}"] = v.hex()
        etree.SubElement(payload, f"{{{SWID_NS}}}Resource", attrib=attrib)
    pems = [c.public_bytes(Encoding.PEM).decode() for c in chain]
    signed = XMLSigner(signature_algorithm=SignatureMethod.ECDSA_SHA384, digest_algorithm="sha384").sign(
        root, key=key, cert=pems)
    return bytes(etree.tostring(signed, xml_declaration=True, encoding="utf-8"))
