"""Collateral from the vendors' services (issue 31 item 3), through a :class:`.collateral_cache.CollateralCache`.

* TDX collateral from a PCCS or Intel's PCS (API v4): ``/sgx/certification/v4/pckcrl?ca=<platform|processor>``
  (the CRL, DER or its hex; issuer chain in ``SGX-PCK-CRL-Issuer-Chain``), ``/tdx/certification/v4/tcb?fmspc=``
  (``{"tcbInfo", "signature"}``; chain in ``TCB-Info-Issuer-Chain``), ``/tdx/certification/v4/qe/identity``
  (``{"enclaveIdentity", "signature"}``; chain in ``SGX-Enclave-Identity-Issuer-Chain``) and
  ``/sgx/certification/v4/rootcacrl``, assembled as dcap-qvl's ``QuoteCollateralV3`` JSON. The signed JSON is
  kept byte for byte as served. A server that answers for another FMSPC, another TEE or another version is
  refused by name (``collateral-fmspc``, ``collateral-version``), before dcap-qvl checks the signatures.
* SEV-SNP VCEKs from AMD's KDS: ``/vcek/v1/<Product>/<hwid hex>?blSPL=&teeSPL=&snpSPL=&ucodeSPL=`` (Turin: 8-byte
  hwid and ``fmcSPL``), DER. A VCEK for another chip or TCB is then refused by the report's own checks.
* NVIDIA RIMs from NVIDIA's RIM service: ``/v1/rim/<id>``, JSON whose ``rim`` is the base64 swidtag; ids
  ``NV_GPU_DRIVER_GH100_<driver>`` and ``NV_GPU_VBIOS_<project>_<project sku>_<chip sku>_<VBIOS, no dots>``.

Every answer is read with a size cap; each entry is cached until its collateral expires. OCSP is not built
(NVIDIA's chains stay "not-checked"). Standard library, ``cryptography`` and ``dcap_qvl`` only.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from .bounded import EVIDENCE_CAP
from .collateral_cache import CollateralCache
from .snp import load_certificate
from .snp_report import SnpReport, Tcb

__all__ = ["ServiceError", "fetch_rim", "fetch_tdx_collateral", "fetch_vcek", "kds_vcek_url", "rim_ids"]

TIMEOUT_S = 20.0
NVIDIA_RIM_URL = "https://rim.attestation.nvidia.com"
AMD_KDS_URL = "https://kdsintf.amd.com"


class ServiceError(ValueError):
    """A service could not be reached, answered an error, or answered something that is not what was asked for;
    ``claim`` names the check (``collateral-fetched``, ``collateral-fmspc``, ``collateral-version``, ...)."""

    def __init__(self, claim: str, reason: str) -> None:
        super().__init__(f"{claim}: {reason}")
        self.claim = claim


Fetch = Callable[[str], tuple[bytes, dict[str, str]]]


def http_get(url: str) -> tuple[bytes, dict[str, str]]:
    """GET ``url``: (body, headers lower-cased), the body read with the evidence cap.

    Raises:
        ServiceError: unreachable, not 200, or larger than the cap (``collateral-fetched``).
    """
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "*/*"}),
                                    timeout=TIMEOUT_S) as resp:
            body = resp.read(EVIDENCE_CAP + 1)
            headers = {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        raise ServiceError("collateral-fetched", f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServiceError("collateral-fetched", f"{url}: {exc}") from None
    if len(body) > EVIDENCE_CAP:
        raise ServiceError("collateral-fetched", f"{url}: the answer is larger than {EVIDENCE_CAP:,} bytes")
    return body, headers


def _iso(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _cached(cache: CollateralCache, url: str, fetch: Fetch, expiry: Callable[[bytes, dict[str, str]], float],
            now: float | None = None) -> tuple[bytes, dict[str, str]]:
    """(body, headers) from the cache (live at ``now``) or fetched and kept until ``expiry(body, headers)``.

    The cache key is the resource (path and query), not the host: a bundle made from one PCCS serves any."""
    parts = urllib.parse.urlsplit(url)
    key = parts.path + ("?" + parts.query if parts.query else "")
    hit = cache.get(key, now=now)
    if hit is not None:
        doc = json.loads(hit)
        return base64.b64decode(doc["body"]), dict(doc["headers"])
    body, headers = fetch(url)
    keep = {k: v for k, v in headers.items() if k.startswith(("sgx-", "tcb-"))}
    cache.put(key, json.dumps({"body": base64.b64encode(body).decode(), "headers": keep}).encode(),
              expires=expiry(body, keep))
    return body, keep


def _chain(headers: dict[str, str], name: str, url: str) -> str:
    value = headers.get(name.lower())
    if not value:
        raise ServiceError("collateral-fetched", f"{url}: no {name} header")
    return urllib.parse.unquote(value)


def _chain_end(pem: str) -> float:
    return min(c.not_valid_after_utc.timestamp() for c in x509.load_pem_x509_certificates(pem.encode()))


def _der_crl(body: bytes) -> bytes:
    """A CRL served as DER, PEM or hex text (PCCS answers hex), as DER."""
    text = body.strip()
    if text.startswith(b"-----BEGIN"):
        return x509.load_pem_x509_crl(text).public_bytes(Encoding.DER)
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return body


def _crl_end(der: bytes) -> float:
    crl = x509.load_der_x509_crl(der)
    return crl.next_update_utc.timestamp() if crl.next_update_utc else 0.0


def _signed_member(body: bytes, member: str, url: str) -> tuple[str, str, dict[str, object]]:
    """The exact text of ``member`` (what the signature covers), the signature, and the member parsed."""
    text = body.decode("utf-8")
    try:
        doc = json.loads(text)
        start = text.index(f'"{member}"')
        start = text.index("{", start)
        parsed, end = json.JSONDecoder().raw_decode(text, start)
        signature = str(doc["signature"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError("collateral-fetched", f"{url}: not a signed {member} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ServiceError("collateral-fetched", f"{url}: {member} is not an object")
    return text[start:end], signature, parsed


def fetch_tdx_collateral(pccs_url: str, quote: bytes, cache: CollateralCache, *,
                         fetch: Fetch = http_get, now: float | None = None) -> str:
    """``QuoteCollateralV3`` JSON for ``quote`` from a PCCS/PCS at ``pccs_url`` (through ``cache``).

    Raises:
        ServiceError: unreachable or an error answer (``collateral-fetched``), TCB info for another FMSPC
            (``collateral-fmspc``), or another TEE or version (``collateral-version``).
        CollateralUnavailable: offline and the bundle lacks a live entry.
    """
    import dcap_qvl

    try:
        parsed = dcap_qvl.parse_quote(quote)
        fmspc, ca = str(parsed.fmspc()).upper(), str(parsed.ca())
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ServiceError("quote-parsed", f"cannot read the quote's FMSPC and CA ({exc})") from None
    base = pccs_url.rstrip("/")
    pck_url = f"{base}/sgx/certification/v4/pckcrl?ca={ca}&encoding=der"
    tcb_url = f"{base}/tdx/certification/v4/tcb?fmspc={fmspc}"
    qe_url = f"{base}/tdx/certification/v4/qe/identity"
    root_url = f"{base}/sgx/certification/v4/rootcacrl"

    def crl_expiry(body: bytes, headers: dict[str, str]) -> float:
        return _crl_end(_der_crl(body))

    def signed_expiry(member: str, chain: str) -> Callable[[bytes, dict[str, str]], float]:
        def expiry(body: bytes, headers: dict[str, str]) -> float:
            _, _, doc = _signed_member(body, member, tcb_url)
            return min(_iso(str(doc["nextUpdate"])), _chain_end(_chain(headers, chain, tcb_url)))
        return expiry

    pck_body, pck_headers = _cached(cache, pck_url, fetch, crl_expiry, now)
    tcb_body, tcb_headers = _cached(cache, tcb_url, fetch, signed_expiry("tcbInfo", "TCB-Info-Issuer-Chain"), now)
    qe_body, qe_headers = _cached(cache, qe_url, fetch, signed_expiry("enclaveIdentity",
                                                                      "SGX-Enclave-Identity-Issuer-Chain"), now)
    root_body, _ = _cached(cache, root_url, fetch, crl_expiry, now)
    tcb_text, tcb_sig, tcb = _signed_member(tcb_body, "tcbInfo", tcb_url)
    qe_text, qe_sig, qe = _signed_member(qe_body, "enclaveIdentity", qe_url)
    if str(tcb.get("fmspc", "")).upper() != fmspc:
        raise ServiceError("collateral-fmspc", f"{tcb_url} answered TCB info for FMSPC {tcb.get('fmspc')}, the "
                           f"quote's is {fmspc}")
    if tcb.get("id") != "TDX" or tcb.get("version") != 3:
        raise ServiceError("collateral-version", f"{tcb_url} answered TCB info {tcb.get('id')} version "
                           f"{tcb.get('version')} (want TDX version 3)")
    if qe.get("id") != "TD_QE" or qe.get("version") != 2:
        raise ServiceError("collateral-version", f"{qe_url} answered identity {qe.get('id')} version "
                           f"{qe.get('version')} (want TD_QE version 2)")
    return json.dumps({
        "pck_crl_issuer_chain": _chain(pck_headers, "SGX-PCK-CRL-Issuer-Chain", pck_url),
        "root_ca_crl": _der_crl(root_body).hex(),
        "pck_crl": _der_crl(pck_body).hex(),
        "tcb_info_issuer_chain": _chain(tcb_headers, "TCB-Info-Issuer-Chain", tcb_url),
        "tcb_info": tcb_text,
        "tcb_info_signature": tcb_sig,
        "qe_identity_issuer_chain": _chain(qe_headers, "SGX-Enclave-Identity-Issuer-Chain", qe_url),
        "qe_identity": qe_text,
        "qe_identity_signature": qe_sig,
    })


def kds_vcek_url(kds_url: str, report: SnpReport, product: str) -> str:
    """The KDS URL of the VCEK for the report's chip id and reported TCB."""
    tcb = Tcb.from_raw(report.reported_tcb, product)
    hwid = report.chip_id[:8] if product == "turin" else report.chip_id
    query = {"blSPL": tcb.boot_loader, "teeSPL": tcb.tee, "snpSPL": tcb.snp, "ucodeSPL": tcb.microcode}
    if tcb.fmc is not None:
        query["fmcSPL"] = tcb.fmc
    return f"{kds_url.rstrip('/')}/vcek/v1/{product.capitalize()}/{hwid.hex()}?{urllib.parse.urlencode(query)}"


def fetch_vcek(kds_url: str, report: SnpReport, product: str, cache: CollateralCache, *,
               fetch: Fetch = http_get, now: float | None = None) -> bytes:
    """The VCEK (DER) for the report's chip and TCB from AMD's KDS, cached until the certificate's end.

    Raises:
        ServiceError: unreachable, an error answer, or not a certificate (``collateral-fetched``).
        CollateralUnavailable: offline and the bundle lacks it.
    """
    url = kds_vcek_url(kds_url, report, product)

    def expiry(body: bytes, headers: dict[str, str]) -> float:
        try:
            return load_certificate(body).not_valid_after_utc.timestamp()
        except ValueError:
            raise ServiceError("collateral-fetched", f"{url}: not a DER certificate") from None

    return _cached(cache, url, fetch, expiry, now)[0]


def rim_ids(report_opaque: dict[int, bytes], driver_version: str, vbios_version: str) -> tuple[str, str]:
    """NVIDIA's RIM ids for a report: driver and VBIOS (project, project SKU, chip SKU from opaque fields 17, 18,
    15)."""
    def text(field: int) -> str:
        return report_opaque.get(field, b"").split(b"\0", 1)[0].decode("ascii", "replace").upper()

    vbios = f"NV_GPU_VBIOS_{text(17)}_{text(18)}_{text(15)}_{vbios_version.replace('.', '').upper()}"
    return f"NV_GPU_DRIVER_GH100_{driver_version}", vbios


def fetch_rim(rim_url: str, rim_id: str, cache: CollateralCache, *, fetch: Fetch = http_get,
              ttl_s: float = 7 * 86400.0, now: float | None = None) -> bytes:
    """A RIM (swidtag XML) from NVIDIA's RIM service, cached for ``ttl_s`` (its signature and chain are checked
    when it is used, at that time).

    Raises:
        ServiceError: unreachable, an error answer, or not the service's JSON (``collateral-fetched``).
    """
    import time

    url = f"{rim_url.rstrip('/')}/v1/rim/{urllib.parse.quote(rim_id)}"
    body, _ = _cached(cache, url, fetch, lambda b, h: (time.time() if now is None else now) + ttl_s, now)
    try:
        doc = json.loads(body)
        return base64.b64decode(str(doc["rim"]), validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ServiceError("collateral-fetched", f"{url}: not a RIM service answer ({exc})") from None
