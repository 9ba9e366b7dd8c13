"""Azure's SEV-SNP confidential VMs: the HCL report from the vTPM and a TPM2 quote by its attestation key.

Azure's guest does not get a raw SNP report: its paravisor (the HCL) stores one in the vTPM's NV index 0x01400001
inside an "HCL report" (little-endian)::

    0   "HCLA" (4)  version (4)  report size (4, header to the end of the runtime data)  request type (4)
        status (4)  reserved (12)
    32  the SNP report (1,184 bytes; :mod:`.snp_report`)
    1216 runtime data header: data size (4, header + JSON)  version (4)  report type (4, 2 = SNP)
         hash type (4, 1 = SHA-256, 2 = SHA-384, 3 = SHA-512)  JSON size (4); then the runtime-data JSON

The SNP report's report_data is the hash of that JSON (zero-padded to 64 bytes); the JSON is a JWK set whose key
``HCLAkPub`` is the vTPM's attestation key (RSA). Freshness comes from a TPM2 quote by that key over the
verifier's nonce (TPMS_ATTEST.extraData), in the serialised form of Azure's ``azure-cvm-tooling``: a u64 length and
the RSASSA-PKCS1-v1_5 SHA-256 signature, a u64 length and the TPMS_ATTEST (big-endian, TCG's layout), a u64 count
and the SHA-256 PCR values, whose digest must be the quote's pcrDigest. Bytes past the report size must be zero,
nothing may follow a quote. Only the standard library and ``cryptography``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from .policy import SnpPolicy
from .snp import SnpVerdict, verify_snp_report
from .snp_report import REPORT_SIZE

__all__ = ["AZURE_PLATFORM", "HclReport", "TpmQuote", "parse_hcl_report", "parse_tpm_quote", "verify_azure_snp",
           "verify_tpm_quote"]

AZURE_PLATFORM = "azure-sev-snp"
HCL_MAGIC = b"HCLA"
HCL_HEADER = 32
RUNTIME_HEADER = 20
REPORT_TYPE_SNP = 2
HASHES = {1: hashlib.sha256, 2: hashlib.sha384, 3: hashlib.sha512}
TPM_GENERATED = 0xFF544347
TPM_ST_ATTEST_QUOTE = 0x8018
TPM_ALG_SHA256 = 0x000B
AK_KID = "HCLAkPub"
MAX_QUOTE = 64 * 1024


class AzureFormatError(ValueError):
    """Not an HCL report or a TPM quote of the expected shape."""


@dataclass(frozen=True, slots=True)
class HclReport:
    snp_report: bytes
    runtime_data: bytes
    hash_type: int

    @property
    def runtime_digest(self) -> bytes:
        return HASHES[self.hash_type](self.runtime_data).digest()

    def ak_public(self) -> rsa.RSAPublicKey:
        """The vTPM attestation key ``HCLAkPub`` of the runtime data.

        Raises:
            AzureFormatError: the JSON has no such RSA key.
        """
        try:
            doc = json.loads(self.runtime_data)
            jwk = next(k for k in doc["keys"] if k.get("kid") == AK_KID)
            n, e = (int.from_bytes(base64.urlsafe_b64decode(jwk[x] + "=" * (-len(jwk[x]) % 4)), "big")
                    for x in ("n", "e"))
            if jwk.get("kty") != "RSA":
                raise ValueError(f"kty {jwk.get('kty')}")
            return rsa.RSAPublicNumbers(e, n).public_key()
        except (ValueError, KeyError, TypeError, StopIteration, binascii.Error) as exc:
            raise AzureFormatError(f"the runtime data names no RSA key {AK_KID!r} ({exc!r})") from None


def parse_hcl_report(data: bytes) -> HclReport:
    """Raises ``AzureFormatError``: wrong magic or report type, sizes out of bounds, non-zero bytes past the end."""
    if len(data) < HCL_HEADER + REPORT_SIZE + RUNTIME_HEADER or data[:4] != HCL_MAGIC:
        raise AzureFormatError(f"not an HCL report (magic {data[:4]!r}, {len(data)} bytes)")
    (total,) = struct.unpack_from("<I", data, 8)
    rt = HCL_HEADER + REPORT_SIZE
    size, _version, report_type, hash_type, json_size = struct.unpack_from("<5I", data, rt)
    if report_type != REPORT_TYPE_SNP:
        raise AzureFormatError(f"report type {report_type} (2 = SNP is read here; a TDX HCL report is not)")
    if hash_type not in HASHES:
        raise AzureFormatError(f"runtime-data hash type {hash_type} (1, 2, 3 = SHA-256/384/512)")
    end = rt + RUNTIME_HEADER + json_size
    if size != RUNTIME_HEADER + json_size or total != end or end > len(data):
        raise AzureFormatError(f"inconsistent sizes (report {total}, runtime data {size}, JSON {json_size}, "
                               f"file {len(data)})")
    if any(data[end:]):
        raise AzureFormatError(f"non-zero bytes after the runtime data (offset {end})")
    return HclReport(snp_report=data[HCL_HEADER:rt], runtime_data=data[rt + RUNTIME_HEADER:end], hash_type=hash_type)


@dataclass(frozen=True, slots=True)
class TpmQuote:
    signature: bytes
    message: bytes
    extra_data: bytes
    pcr_digest: bytes
    pcr_select: tuple[tuple[int, bytes], ...]
    pcrs: tuple[bytes, ...]


def _take(data: bytes, pos: int, n: int) -> tuple[bytes, int]:
    if pos + n > len(data):
        raise AzureFormatError(f"truncated at offset {pos} (wanted {n} bytes of {len(data)})")
    return data[pos:pos + n], pos + n


def parse_tpm_quote(data: bytes) -> TpmQuote:
    """Parse the serialised quote (signature, TPMS_ATTEST, PCRs); trailing bytes are refused.

    Raises:
        AzureFormatError: not a quote of that shape.
    """
    if len(data) > MAX_QUOTE:
        raise AzureFormatError(f"a quote of {len(data):,} bytes (cap {MAX_QUOTE:,})")
    pos, parts = 0, []
    for _ in range(2):
        raw, pos = _take(data, pos, 8)
        part, pos = _take(data, pos, int.from_bytes(raw, "little"))
        parts.append(part)
    raw, pos = _take(data, pos, 8)
    count = int.from_bytes(raw, "little")
    if count > 64 or pos + 32 * count != len(data):
        raise AzureFormatError(f"{count} PCRs and {len(data) - pos} bytes after the message (trailing bytes?)")
    pcrs = tuple(data[pos + 32 * i:pos + 32 * i + 32] for i in range(count))
    sig, msg = parts
    magic, st = struct.unpack_from(">IH", msg, 0) if len(msg) >= 6 else (0, 0)
    if magic != TPM_GENERATED or st != TPM_ST_ATTEST_QUOTE:
        raise AzureFormatError(f"TPMS_ATTEST magic {magic:#x} type {st:#x} (want 0xff544347, 0x8018: a quote)")
    p = 6
    raw, p = _take(msg, p, 2)
    _signer, p = _take(msg, p, int.from_bytes(raw, "big"))
    raw, p = _take(msg, p, 2)
    extra, p = _take(msg, p, int.from_bytes(raw, "big"))
    _clock, p = _take(msg, p, 17 + 8)  # clockInfo (clock, resetCount, restartCount, safe), firmwareVersion
    raw, p = _take(msg, p, 4)
    select = []
    for _ in range(int.from_bytes(raw, "big")):
        head, p = _take(msg, p, 3)
        bits, p = _take(msg, p, head[2])
        select.append((int.from_bytes(head[:2], "big"), bits))
    raw, p = _take(msg, p, 2)
    digest, p = _take(msg, p, int.from_bytes(raw, "big"))
    if p != len(msg):
        raise AzureFormatError(f"{len(msg) - p} bytes after the TPMS_ATTEST's pcrDigest")
    return TpmQuote(sig, msg, extra, digest, tuple(select), pcrs)


def verify_tpm_quote(quote: TpmQuote, ak: rsa.RSAPublicKey, nonce: bytes) -> tuple[str, str]:
    """``('', '')`` when the AK signed the quote, its extraData is ``nonce`` and its PCRs match the digest;
    else ``(claim, reason)``: ``tpm-quote-verified``, ``tpm-nonce-match`` or ``pcr-digest-match``."""
    try:
        ak.verify(quote.signature, quote.message, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return "tpm-quote-verified", "the quote's signature does not verify with the attestation key (RSA SHA-256)"
    if quote.extra_data != nonce:
        return "tpm-nonce-match", f"the quote's extraData is {quote.extra_data.hex()}, the nonce {nonce.hex()}"
    if quote.pcrs:
        if any(alg != TPM_ALG_SHA256 for alg, _ in quote.pcr_select):
            return "pcr-digest-match", "the quote selects a bank other than SHA-256"
        chosen = [i for _, bits in quote.pcr_select for i in range(8 * len(bits)) if bits[i // 8] >> (i % 8) & 1]
        if len(chosen) != len(quote.pcrs) or hashlib.sha256(b"".join(quote.pcrs)).digest() != quote.pcr_digest:
            return "pcr-digest-match", "the PCR values given do not hash to the quote's pcrDigest"
    return "", ""


def verify_azure_snp(hcl: bytes, vcek: bytes, quote: bytes, nonce: bytes, *, product: str | None = None,
                     now: int | None = None, policy: SnpPolicy | None = None) -> SnpVerdict:
    """The HCL report (its SNP report checked as :func:`.snp.verify_snp_report` does), the runtime data bound by
    its report_data, and the quote by ``HCLAkPub`` over ``nonce``; never raises."""
    checks: dict[str, bool] = {}

    def refused(claim: str, reason: str, base: SnpVerdict | None = None) -> SnpVerdict:
        c = {**(base.checks if base else checks), claim: False}
        if base is not None:
            return replace(base, ok=False, platform=AZURE_PLATFORM, failed=claim, reason=reason, checks=c)
        return SnpVerdict(ok=False, platform=AZURE_PLATFORM, failed=claim, reason=reason, checks=c)

    try:
        report = parse_hcl_report(hcl)
    except AzureFormatError as exc:
        return refused("hcl-report-parsed", str(exc))
    checks["hcl-report-parsed"] = True
    digest = report.runtime_digest  # the binding first: it needs no key, and says what the report vouches for
    if report.snp_report[0x50:0x90] != digest.ljust(64, b"\0"):
        return refused("runtime-data-bound", f"report_data {report.snp_report[0x50:0x70].hex()[:16]}... is not "
                       f"the hash of the runtime data ({digest.hex()[:16]}...)")
    checks["runtime-data-bound"] = True
    snp = verify_snp_report(report.snp_report, vcek, product=product, now=now, policy=policy)
    snp = replace(snp, platform=AZURE_PLATFORM, checks={**checks, **snp.checks})
    if not snp.ok:
        return snp
    try:
        ak = report.ak_public()
        parsed = parse_tpm_quote(quote)
    except AzureFormatError as exc:
        return refused("tpm-quote-verified", str(exc), snp)
    checks = dict(snp.checks)
    claim, reason = verify_tpm_quote(parsed, ak, nonce)
    if claim:
        return refused(claim, reason, snp)
    return replace(snp, checks={**checks, "tpm-quote-verified": True, "tpm-nonce-match": True,
                                "pcr-digest-match": True})


def ak_from_pem(data: bytes) -> rsa.RSAPublicKey:
    """An RSA attestation key from a PEM public key (azure-cvm-tooling's ``akpub.pem``)."""
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, rsa.RSAPublicKey):
        raise AzureFormatError("the attestation key is not RSA")
    return key
