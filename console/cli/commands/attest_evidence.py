"""``gputravel attest`` on real-format evidence, offline: an NVIDIA GPU's SPDM report or an Intel TDX quote.

``--evidence FILE --cert-chain FILE --nonce HEX [--rim FILE ...]`` checks a GPU's GET_MEASUREMENTS report;
``--tdx-quote FILE --collateral FILE [--at UNIX_TIME]`` checks a TD's quote. Exit 0 when every claim holds, 3
(``AttestationError``) naming the first claim that failed; unreadable input is a ``DataError`` (2), a bad policy
file a ``ConfigError`` (2).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.console.cli.tdx_words import collateral_window, tdx_reason_in_words
from gputravel.core.errors import AttestationError, ConfigError, DataError
from gputravel.core.evidence.bounded import EvidenceTooLarge, read_capped
from gputravel.core.evidence.policy import EvidencePolicy, PolicyError, load_evidence_policy

__all__ = ["attest_gpu_evidence", "attest_sim_formats", "attest_tdx_quote", "finish_verdict", "read_evidence",
           "report_data_arg", "verified_at"]


def read_evidence(path: Path, what: str) -> bytes:
    """The file's bytes, refused (exit 2) over the evidence cap after one bounded read (every ``attest`` form
    of real-format evidence reads its files here: this module's and ``attest_snp.py``'s)."""
    try:
        return read_capped(path, what=what)
    except EvidenceTooLarge as exc:
        raise DataError(str(exc)) from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read the {what} ({exc.strerror})") from exc


def _policy(path: Path | None) -> EvidencePolicy:
    try:
        return load_evidence_policy(path)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc


def _nonce(text: str) -> bytes:
    clean = text.strip().removeprefix("0x")
    if not re.fullmatch(r"[0-9a-fA-F]{64}", clean):
        raise DataError(f"--nonce must be 32 bytes as 64 hex digits (got {len(clean)} characters)")
    return bytes.fromhex(clean)


def verified_at(at: int | None) -> str:
    """The time a verdict was reached as of (``--at`` or now), ISO 8601 UTC: every CVM verdict's ``verified_at``."""
    return dt.datetime.fromtimestamp(int(time.time()) if at is None else at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def report_data_arg(text: str | None) -> bytes | None:
    """``--report-data HEX``: the 1 to 64 bytes a CVM report must carry (zero-padded to 64), or None."""
    if text is None:
        return None
    clean = text.strip().removeprefix("0x")
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2}){1,64}", clean):
        raise DataError(f"--report-data must be 1 to 64 bytes as hex digits (got {len(clean)} characters)")
    return bytes.fromhex(clean)


def finish_verdict(doc: dict[str, Any], *, json_out: bool, console_render: Callable[[], None],
                   failed_reason: str | None = None) -> None:
    """The one ending of every ``attest`` form of real-format evidence (GPU, TDX, SIM formats, SNP): the JSON
    document or the table, then, when a check failed, its name and reason on stderr and exit 3.
    ``failed_reason``: for a document without a ``failed_reason`` key (SNP's)."""
    if json_out:
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        console_render()
    if not doc["ok"]:
        reason = failed_reason if failed_reason is not None else doc["failed_reason"]
        Console(stderr=True).print(
            f"[bold red]attestation failed[/]: {escape(str(doc['failed_claim']))}: {escape(str(reason))}",
            highlight=False, soft_wrap=True)
        raise typer.Exit(code=AttestationError.exit_code)


def _service_rims(report: bytes, rim_url: str, offline: Path | None) -> list[bytes]:
    """The driver and VBIOS RIMs for the report's versions, from NVIDIA's RIM service (or the bundle)."""
    from gputravel.console.cli.commands.evidence_fetch import cache_for, fetched
    from gputravel.core.evidence.nvidia_spdm import EvidenceFormatError, parse_report, read_hex_or_raw
    from gputravel.core.evidence.services import fetch_rim, rim_ids

    try:
        parsed = parse_report(read_hex_or_raw(report))
    except EvidenceFormatError:
        return []  # the verdict says why (-parsed)
    cache = cache_for(offline)
    return [fetched(functools.partial(fetch_rim, rim_url, rid, cache))
            for rid in rim_ids(dict(parsed.opaque), parsed.driver_version, parsed.vbios_version)]


def attest_gpu_evidence(*, evidence: Path, cert_chain: Path | None, nonce: str | None, rims: list[Path],
                        at: int | None, policy: Path | None, json_out: bool, rim_url: str | None = None,
                        offline: Path | None = None, ocsp_url: str | None = None) -> None:
    """Verify an NVIDIA GPU's evidence files; print claims; exit 0 or 3."""
    from gputravel.core.evidence.nvidia_gpu import verify_gpu

    if cert_chain is None or nonce is None:
        raise DataError("--evidence needs --cert-chain FILE and --nonce HEX (the nonce the report must carry)")
    report = read_evidence(evidence, "GPU attestation report")
    rim_files = [read_evidence(r, "RIM") for r in rims]
    if rim_url is not None:
        rim_files += _service_rims(report, rim_url, offline)
    verdict = verify_gpu(
        report, read_evidence(cert_chain, "certificate chain"), _nonce(nonce),
        rims=rim_files, policy=_policy(policy).gpu,
        at=dt.datetime.fromtimestamp(at, dt.UTC) if at is not None else None, ocsp_url=ocsp_url,
    )
    doc = verdict.to_json()

    def render() -> None:
        console = Console()
        table = Table(title="NVIDIA GPU evidence (offline)", title_justify="left")
        table.add_column("claim", style="bold", overflow="fold")
        table.add_column("", justify="center")
        table.add_column("value / detail", overflow="fold")
        for claim in verdict.claims:
            mark = {True: "[green]✓[/]", False: "[bold red]✗[/]", None: "[yellow]–[/]"}[claim.ok]
            text = f"{claim.value}" + (f"  ({claim.detail})" if claim.detail else "")
            table.add_row(escape(claim.name), mark, escape(text))
        console.print(table)
        console.print(f"verdict: {'[bold green]PASS[/]' if verdict.ok else '[bold red]FAIL[/]'}")

    finish_verdict(doc, json_out=json_out, console_render=render)


def attest_tdx_quote(*, quote: Path, collateral: Path | None, at: int | None, policy: Path | None,
                     json_out: bool, pccs_url: str | None = None, offline: Path | None = None,
                     report_data: str | None = None) -> None:
    """Verify an Intel TDX quote with its collateral (a file, or fetched from a PCCS); print the verdict; exit 0
    or 3."""
    from gputravel.core.evidence.tdx import verify_tdx_quote

    if (collateral is None) == (pccs_url is None):
        raise DataError("--tdx-quote needs --collateral FILE (QuoteCollateralV3 JSON) or --pccs-url URL, one of them")
    raw = read_evidence(quote, "TDX quote")
    if pccs_url is not None:
        from gputravel.console.cli.commands.evidence_fetch import cache_for, fetched
        from gputravel.core.evidence.services import fetch_tdx_collateral

        cache = cache_for(offline)
        collateral_bytes = fetched(lambda: fetch_tdx_collateral(pccs_url, raw, cache, now=at)).encode()
    else:
        assert collateral is not None
        collateral_bytes = read_evidence(collateral, "collateral")
    expected = report_data_arg(report_data)
    verdict = verify_tdx_quote(raw, collateral_bytes, now=at, policy=_policy(policy).tdx,
                               expected_report_data=expected)
    if verdict.failed == "collateral-parsed":  # unreadable input, not an attestation verdict: exit 2
        raise DataError(f"{collateral or pccs_url}: {verdict.reason} (the collateral is dcap-qvl's "
                        f"QuoteCollateralV3 JSON)")
    doc = verdict.to_json()
    doc["verified_at"] = verified_at(at)
    window = collateral_window(collateral_bytes)
    doc["collateral_valid"] = ({"from": f"{window[0]:%Y-%m-%dT%H:%M:%SZ}", "to": f"{window[1]:%Y-%m-%dT%H:%M:%SZ}"}
                               if window else None)  # the TCB info's issueDate and nextUpdate
    if verdict.failed and verdict.reason:
        doc["failed_reason"] = tdx_reason_in_words(verdict.reason, at=int(time.time()) if at is None else at,
                                                   collateral=collateral_bytes)
        doc["verifier_reason"] = verdict.reason  # dcap-qvl's own words, as it gave them

    def render() -> None:
        console = Console()
        table = Table(title="Intel TDX quote (offline)", title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        for key in ("tcb_status", "advisory_ids", "mr_td", "rtmrs", "report_data", "debug"):
            table.add_row(key, escape(str(doc[key])))
        for name, ok in verdict.checks.items():
            table.add_row(name, "[green]✓[/]" if ok else "[bold red]✗[/]")
        for name, why in verdict.not_checked.items():
            table.add_row(name, f"[yellow]–[/] not checked: {escape(why)}")
        console.print(table)
        console.print(f"verdict: {'[bold green]PASS[/]' if verdict.ok else '[bold red]FAIL[/]'}")

    finish_verdict(doc, json_out=json_out, console_render=render)


def attest_sim_formats(*, state_dir: Path, out: Path | None, json_out: bool) -> None:
    """The SIM platform's evidence in NVIDIA's and Intel's formats, made fresh and verified under the SIM roots."""
    import hashlib
    import os
    import time

    from gputravel.core.evidence.nvidia_gpu import verify_gpu
    from gputravel.core.evidence.sim_store import load_or_create
    from gputravel.core.evidence.tdx import verify_tdx_quote

    gpu, tdx, policy_path = load_or_create(state_dir)
    policy = _policy(policy_path)
    nonce = os.urandom(32)
    report_data = hashlib.sha512(b"gputravel SIM CVM|" + nonce).digest()
    report, chain, rims = gpu.report(nonce), gpu.cert_chain_pem(), list(gpu.rims())
    now = int(time.time())
    quote = tdx.quote(report_data)
    collateral = tdx.collateral(issued=dt.datetime.fromtimestamp(now - 3600, dt.UTC))
    g = verify_gpu(report, chain, nonce, rims=rims, policy=policy.gpu)
    t = verify_tdx_quote(quote, collateral, now=now, policy=policy.tdx)
    files: dict[str, str] = {}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        blobs = {"gpu-report.bin": report, "gpu-chain.pem": chain, "driver-rim.swidtag": rims[0],
                 "vbios-rim.swidtag": rims[1], "tdx-quote.bin": quote, "tdx-collateral.json": collateral.encode(),
                 "nonce.txt": nonce.hex().encode() + b"\n"}
        for name, data in blobs.items():
            (out / name).write_bytes(data)
            files[name] = str(out / name)
    failed = (f"nvidia-gpu: {g.failed.name}" if g.failed else None) or (f"intel-tdx: {t.failed}" if t.failed
                                                                          else None)
    doc: dict[str, Any] = {
        "ok": g.ok and t.ok,
        "platform": {"kind": "emulated", "sim": True, "label": "SIM"},
        "policy": str(policy_path),
        "nvidia-gpu": g.to_json(),
        "intel-tdx": t.to_json(),
        "files": files,
        "failed_claim": failed,
        "failed_reason": (g.failed.detail if g.failed else t.reason) if failed else None,
    }

    def render() -> None:
        console = Console()
        console.print("[bold black on yellow] SIM [/] vendor-format evidence of the emulated platform "
                      "(no CC-mode H100, no TDX guest)")
        console.print(f"GPU (SPDM 1.1, 5-certificate SIM chain, SIM RIMs): "
                      f"{'[green]PASS[/]' if g.ok else '[bold red]FAIL[/]'}; measres "
                      f"{escape(str(g.claims.values().get('measres')))}")
        console.print(f"CVM (TDX v4 quote, SIM PCK chain, SIM collateral): "
                      f"{'[green]PASS[/]' if t.ok else '[bold red]FAIL[/]'}; TCB {escape(str(t.tcb_status))}")
        console.print(f"SIM roots pinned by {escape(str(policy_path))}")
        if files:
            console.print(f"files in {escape(str(out))}: gputravel attest --evidence gpu-report.bin --cert-chain "
                          f"gpu-chain.pem --nonce $(cat nonce.txt) --rim driver-rim.swidtag --rim vbios-rim.swidtag "
                          f"--policy {escape(str(policy_path))}")

    finish_verdict(doc, json_out=json_out, console_render=render)
