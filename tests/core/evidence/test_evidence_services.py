"""Collateral from the vendors' services (issue 31 item 3), against a local HTTP server (127.0.0.1) that speaks
Intel's PCS API v4, AMD's KDS and NVIDIA's RIM service from recorded files: dcap-qvl's real collateral, virtee's
real VCEK, NVIDIA's real RIM. What it serves verifies; a server that lies (another FMSPC, another version) and an
expired bundle are refused by name; an offline bundle verifies with no server at all."""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from evidence_samples import (  # noqa: F401 (the *_fixture names are pytest fixtures)
    RIM_VALID_AT,
    NvidiaSample,
    nv_wheel_fixture,
    sample_fixture,
)
from helpers import DATA_DIR
from helpers import MILAN_REPORT as SNP_REPORT
from helpers import MILAN_VCEK as VCEK
from helpers import TDX_QUOTE as QUOTE

from gputravel.core.evidence.collateral_cache import CollateralCache, CollateralUnavailable
from gputravel.core.evidence.nvidia_rim import verify_rim
from gputravel.core.evidence.services import (
    ServiceError,
    fetch_rim,
    fetch_tdx_collateral,
    fetch_vcek,
    kds_vcek_url,
)
from gputravel.core.evidence.snp import verify_snp_report
from gputravel.core.evidence.snp_report import parse_snp_report
from gputravel.core.evidence.tdx import verify_tdx_quote

COLLATERAL = json.loads((DATA_DIR / "intel-tdx" / "tdx_quote_collateral.json").read_text())
AT = 1750331763


class Recorded(BaseHTTPRequestHandler):
    """PCS v4, KDS and the RIM service, from recorded files; ``lie`` makes it answer something else."""

    lie: str | None = None
    rims: dict[str, bytes] = {}
    hits: list[str] = []

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, body: bytes, headers: dict[str, str] | None = None, status: int = 200) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, urllib.parse.quote(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        type(self).hits.append(url.path)
        c = COLLATERAL
        if url.path == "/sgx/certification/v4/pckcrl" and q.get("ca") == "platform":
            self._send(bytes.fromhex(c["pck_crl"]), {"SGX-PCK-CRL-Issuer-Chain": c["pck_crl_issuer_chain"]})
        elif url.path == "/tdx/certification/v4/tcb":
            info = c["tcb_info"]
            if self.lie == "fmspc":
                info = info.replace(q["fmspc"], "00A06F000000")
            elif self.lie == "version":
                info = info.replace('"version":3', '"version":2')
            elif q.get("fmspc") != "B0C06F000000":
                return self._send(b"", status=404)
            body = f'{{"tcbInfo":{info},"signature":"{c["tcb_info_signature"]}"}}'.encode()
            self._send(body, {"TCB-Info-Issuer-Chain": c["tcb_info_issuer_chain"]})
        elif url.path == "/tdx/certification/v4/qe/identity":
            body = f'{{"enclaveIdentity":{c["qe_identity"]},"signature":"{c["qe_identity_signature"]}"}}'.encode()
            self._send(body, {"SGX-Enclave-Identity-Issuer-Chain": c["qe_identity_issuer_chain"]})
        elif url.path == "/sgx/certification/v4/rootcacrl":
            self._send(c["root_ca_crl"].encode())  # a PCCS answers hex
        elif url.path.startswith("/vcek/v1/Milan/"):
            self._send(VCEK)
        elif url.path.startswith("/v1/rim/") and url.path[8:] in self.rims:
            rid = url.path[8:]
            self._send(json.dumps({"id": rid, "rim": base64.b64encode(self.rims[rid]).decode()}).encode())
        else:
            self._send(b"not found", status=404)


@pytest.fixture
def server() -> Iterator[tuple[str, type[Recorded]]]:
    handler = type("Handler", (Recorded,), {"lie": None, "rims": {}, "hits": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_tdx_collateral_from_a_pcs_verifies_and_is_cached(server: tuple[str, type[Recorded]], tmp_path: Path) -> None:
    url, handler = server
    cache = CollateralCache(tmp_path / "cache")
    collateral = fetch_tdx_collateral(url, QUOTE, cache, now=AT)
    verdict = verify_tdx_quote(QUOTE, collateral, now=AT)
    assert verdict.ok and verdict.tcb_status == "UpToDate", verdict.reason
    assert len(handler.hits) == 4
    assert fetch_tdx_collateral(url, QUOTE, cache, now=AT) == collateral
    assert len(handler.hits) == 4  # all four answers came from the cache


@pytest.mark.parametrize(("lie", "claim"), [("fmspc", "collateral-fmspc"), ("version", "collateral-version")])
def test_a_pcs_that_lies_is_refused_by_name(server: tuple[str, type[Recorded]], tmp_path: Path, lie: str,
                                            claim: str) -> None:
    url, handler = server
    handler.lie = lie
    with pytest.raises(ServiceError) as info:
        fetch_tdx_collateral(url, QUOTE, CollateralCache(tmp_path / "cache"), now=AT)
    assert info.value.claim == claim


def test_an_unreachable_service_is_named(tmp_path: Path) -> None:
    with pytest.raises(ServiceError) as info:
        fetch_tdx_collateral("http://127.0.0.1:9", QUOTE, CollateralCache(tmp_path / "cache"), now=AT)
    assert info.value.claim == "collateral-fetched"


def test_an_offline_bundle_verifies_without_a_server_and_an_expired_one_is_refused(
        server: tuple[str, type[Recorded]], tmp_path: Path) -> None:
    url, _ = server
    cache = CollateralCache(tmp_path / "cache")
    fetch_tdx_collateral(url, QUOTE, cache, now=AT)
    keys = [json.loads((tmp_path / "cache" / "manifest.json").read_text())[n]["key"]
            for n in json.loads((tmp_path / "cache" / "manifest.json").read_text())]
    cache.export(tmp_path / "bundle", keys, now=AT)
    bundle = CollateralCache(tmp_path / "bundle", offline=True)

    def no_network(u: str) -> tuple[bytes, dict[str, str]]:
        raise AssertionError(f"an offline bundle fetched {u}")

    collateral = fetch_tdx_collateral("http://unused.invalid", QUOTE, bundle, fetch=no_network, now=AT)
    assert verify_tdx_quote(QUOTE, collateral, now=AT).ok
    with pytest.raises(CollateralUnavailable) as info:
        fetch_tdx_collateral("http://unused.invalid", QUOTE, bundle, fetch=no_network, now=AT + 60 * 86400)
    assert info.value.claim == "bundle-expired"


def test_the_vcek_from_a_kds_verifies_the_report(server: tuple[str, type[Recorded]], tmp_path: Path) -> None:
    url, handler = server
    report = parse_snp_report(SNP_REPORT)
    assert kds_vcek_url(url, report, "milan").endswith("?blSPL=3&teeSPL=0&snpSPL=8&ucodeSPL=115")
    vcek = fetch_vcek(url, report, "milan", CollateralCache(tmp_path / "cache"))
    assert vcek == VCEK and verify_snp_report(SNP_REPORT, vcek).ok


def test_a_kds_that_answers_another_chips_vcek_is_refused_by_the_report(
        server: tuple[str, type[Recorded]], tmp_path: Path) -> None:
    url, _ = server
    other = bytearray(SNP_REPORT)
    other[0x1A0] ^= 1  # another chip id: the (recorded) KDS still answers virtee's VCEK
    vcek = fetch_vcek(url, parse_snp_report(bytes(other)), "milan", CollateralCache(tmp_path / "cache"))
    assert not verify_snp_report(bytes(other), vcek).ok


def test_a_rim_from_the_rim_service_verifies(server: tuple[str, type[Recorded]], tmp_path: Path,
                                             sample: NvidiaSample) -> None:
    url, handler = server
    handler.rims = {"NV_GPU_VBIOS_1010_0200_882_96005E0001": sample.vbios_rim}
    rim = fetch_rim(url, "NV_GPU_VBIOS_1010_0200_882_96005E0001", CollateralCache(tmp_path / "cache"))
    claims, parsed = verify_rim(rim, expected_version="96.00.5E.00.01", at=RIM_VALID_AT)
    assert parsed is not None and parsed.ok
    with pytest.raises(ServiceError, match="HTTP 404"):
        fetch_rim(url, "NV_GPU_DRIVER_GH100_550.90.07", CollateralCache(tmp_path / "cache"))


# --- the commands -----------------------------------------------------------------------------------------------
def test_cli_fetches_bundles_and_verifies_offline(server: tuple[str, type[Recorded]], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from gputravel.console.cli.main import app

    url, _ = server
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    quote, report = DATA_DIR / "intel-tdx" / "tdx_quote", DATA_DIR / "amd-snp" / "report_milan.hex"
    online = CliRunner().invoke(app, ["attest", "--tdx-quote", str(quote), "--pccs-url", url, "--at", str(AT),
                                      "--json"])
    assert online.exit_code == 0, online.output
    assert json.loads(online.stdout)["tcb_status"] == "UpToDate"
    bundle = tmp_path / "bundle"
    made = CliRunner().invoke(app, ["evidence", "bundle", "--out", str(bundle), "--tdx-quote", str(quote),
                                    "--pccs-url", url, "--snp-report", str(report), "--kds-url", url, "--product",
                                    "milan", "--at", str(AT), "--json"])
    assert made.exit_code == 0, made.output
    assert len(json.loads(made.stdout)["entries"]) == 5  # four PCS answers and one VCEK
    offline = ["--pccs-url", "http://127.0.0.1:9", "--offline", str(bundle)]  # nothing listens there
    ok = CliRunner().invoke(app, ["attest", "--tdx-quote", str(quote), *offline, "--at", str(AT)])
    assert ok.exit_code == 0, ok.output
    snp = CliRunner().invoke(app, ["attest", "--snp-report", str(report), "--kds-url", "http://127.0.0.1:9",
                                   "--offline", str(bundle), "--product", "milan", "--at", str(AT)])
    assert snp.exit_code == 0, snp.output
    expired = CliRunner().invoke(app, ["attest", "--tdx-quote", str(quote), *offline, "--at", str(AT + 60 * 86400)])
    assert expired.exit_code == 3 and "bundle-expired" in expired.output


def test_cli_names_a_lying_pcs_with_exit_3(server: tuple[str, type[Recorded]], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from gputravel.console.cli.main import app

    url, handler = server
    handler.lie = "fmspc"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    out = CliRunner().invoke(app, ["attest", "--tdx-quote", str(DATA_DIR / "intel-tdx" / "tdx_quote"),
                                   "--pccs-url", url, "--at", str(AT)])
    assert out.exit_code == 3 and "collateral-fmspc" in out.output
