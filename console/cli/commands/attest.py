"""``gputravel attest``: attest the (emulated) GPU and show every claim; or, offline, verify real-format evidence
(an NVIDIA GPU's SPDM report with ``--evidence``, an Intel TDX quote with ``--tdx-quote``: see attest_evidence; an
AMD SEV-SNP report with ``--snp-report``, Azure's HCL report with ``--azure-hcl``: see attest_snp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import platformdirs
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.core.attestation import (
    PLATFORM_EMULATED,
    AttestationResult,
    Injection,
    load_policy,
    run_emulated_attestation,
)
from gputravel.core.errors import AttestationError, DataError


def default_state_dir() -> Path:
    """Where the emulated vendor PKI and device identity live between runs."""
    return Path(platformdirs.user_state_dir("gputravel")) / "emulated"


def cipher_engine() -> dict[str, str]:
    """Which engine a device service started here would seal/open the data path with (``auto``)."""
    from gputravel.core.platform.emulated import describe_cipher_engine

    label, reason = describe_cipher_engine("auto")
    return {"label": label, "reason": reason}


def result_json(result: AttestationResult, *, inject: str | None) -> dict[str, Any]:
    """The ``--json`` document (no key material: fingerprints only)."""
    body = result.to_dict()
    sim = result.platform == PLATFORM_EMULATED
    return {
        # "label" is the literal SIM marker every emulated output carries (null on real hardware)
        "platform": {"kind": result.platform, "sim": sim, "label": "SIM" if sim else None},
        "ok": result.ok,
        "device_id": result.device_id,
        "device_key_fingerprint": body["device_key_fingerprint"],
        "cc_mode": body["cc_mode"],
        "measurements": body["measurements"],
        "injected": inject,
        "claims": body["claims"],
        "token": body["token"],
        # who opens provisioning chunks (and seals secure ring hops) on this machine: "cpu (cryptography)",
        # "gpu (cuda)"; `gputravel run --cipher-engine` overrides it
        "cipher_engine": cipher_engine(),
    }


def render(console: Console, result: AttestationResult, *, inject: str | None) -> None:
    """Print the claims as a table, with the SIM marker when the platform is emulated."""
    table = Table(title=f"Attestation of {result.device_id or 'unknown device'}", title_justify="left")
    table.add_column("claim", style="bold")
    table.add_column("", justify="center")
    table.add_column("detail", overflow="fold")
    for claim in result.claims:
        mark = "[green]✓[/]" if claim.ok else "[bold red]✗[/]"
        table.add_row(escape(claim.name), mark, escape(str(claim.detail)))
    console.print(table)
    if result.platform == PLATFORM_EMULATED:
        console.print("[bold black on yellow] SIM [/] platform: emulated (SIM) — no TDX/CC-mode H100 was used")
    else:
        console.print(f"platform: {escape(str(result.platform))}")
    engine = cipher_engine()
    console.print(f"data path cipher: [bold]{escape(engine['label'])}[/] ({escape(engine['reason'])})")
    if inject:
        console.print(f"injected fault: [bold]{escape(str(inject))}[/]")
    if result.token is not None:
        console.print(f"token issued, valid for {result.token.expires_at - result.token.issued_at:.0f} s")
    verdict = "[bold green]PASS[/]" if result.ok else "[bold red]FAIL[/]"
    console.print(f"verdict: {verdict}")


def attest(
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    inject: Annotated[
        Injection | None, typer.Option("--inject", help="Inject a fault to see attestation fail.")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option("--state-dir", help="Emulated vendor PKI and device identity (default: user state dir)."),
    ] = None,
    policy: Annotated[
        Path | None, typer.Option("--policy", help="Attestation policy TOML (default: the shipped one; with "
                                  "--evidence/--tdx-quote: the evidence policy, core/policy/evidence.toml).")
    ] = None,
    evidence: Annotated[
        Path | None, typer.Option("--evidence", help="NVIDIA GPU attestation report (SPDM GET_MEASUREMENTS "
                                  "request + response), raw or hex text: verify it offline.")
    ] = None,
    cert_chain: Annotated[
        Path | None, typer.Option("--cert-chain", help="The GPU's PEM certificate chain, leaf first (with --evidence).")
    ] = None,
    nonce: Annotated[
        str | None, typer.Option("--nonce", help="The 32-byte nonce the report must carry, hex (with --evidence).")
    ] = None,
    report_data: Annotated[
        str | None, typer.Option("--report-data", help="With --snp-report/--tdx-quote: the report data (1 to 64 "
                                 "bytes, hex, zero-padded to 64) the report must carry: your nonce. Without it "
                                 "freshness is not checked.")
    ] = None,
    rim: Annotated[
        list[Path] | None, typer.Option("--rim", help="NVIDIA-signed driver or VBIOS RIM (swidtag), repeatable.")
    ] = None,
    tdx_quote: Annotated[
        Path | None, typer.Option("--tdx-quote", help="Intel TDX quote (version 4), raw: verify it offline.")
    ] = None,
    collateral: Annotated[
        Path | None, typer.Option("--collateral", help="The quote's collateral, dcap-qvl QuoteCollateralV3 JSON.")
    ] = None,
    snp_report: Annotated[
        Path | None, typer.Option("--snp-report", help="AMD SEV-SNP attestation report (1,184 bytes, raw or hex): "
                                  "verify it offline with --vcek.")
    ] = None,
    azure_hcl: Annotated[
        Path | None, typer.Option("--azure-hcl", help="Azure's HCL report (vTPM NV index 0x01400001): its SNP "
                                  "report, runtime data and --tpm-quote over --nonce, with --vcek.")
    ] = None,
    vcek: Annotated[
        Path | None, typer.Option("--vcek", help="The chip's VCEK (or VLEK) certificate, DER or PEM (with "
                                  "--snp-report/--azure-hcl).")
    ] = None,
    tpm_quote: Annotated[
        Path | None, typer.Option("--tpm-quote", help="A TPM2 quote by the vTPM key HCLAkPub (with --azure-hcl).")
    ] = None,
    product: Annotated[
        str | None, typer.Option("--product", help="milan, genoa or turin (default: the VCEK's issuer says).")
    ] = None,
    pccs_url: Annotated[
        str | None, typer.Option("--pccs-url", help="With --tdx-quote: fetch the collateral from this PCCS or "
                                 "Intel's PCS (API v4) instead of --collateral (cached with its expiry).")
    ] = None,
    kds_url: Annotated[
        str | None, typer.Option("--kds-url", help="With --snp-report/--azure-hcl: fetch the VCEK from AMD's KDS "
                                 "(https://kdsintf.amd.com) by chip id and TCB instead of --vcek.")
    ] = None,
    rim_url: Annotated[
        str | None, typer.Option("--rim-url", help="With --evidence: fetch the driver and VBIOS RIMs for the "
                                 "report's versions from NVIDIA's RIM service (https://rim.attestation.nvidia.com).")
    ] = None,
    ocsp_url: Annotated[
        str | None, typer.Option("--ocsp-url", help="With --evidence: ask this OCSP service (NVIDIA's: "
                                 "https://ocsp.ndis.nvidia.com) about the GPU's chain, with a fresh nonce.")
    ] = None,
    offline: Annotated[
        Path | None, typer.Option("--offline", help="Take fetched collateral only from this bundle "
                                  "(gputravel evidence bundle --out); an entry missing or expired is refused.")
    ] = None,
    at: Annotated[
        int | None, typer.Option("--at", help="Verify as of this Unix time (default: now).")
    ] = None,
    sim_formats: Annotated[
        bool, typer.Option("--sim-formats", help="Make and verify the SIM platform's evidence in NVIDIA's and "
                           "Intel's formats (SPDM + RIMs, TDX v4 quote + collateral) under the SIM roots.")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="With --sim-formats: write the SIM evidence files here.")
    ] = None,
) -> None:
    """Attest the GPU: certificate chain, revocation, signature, nonce, measurements, CC mode.

    With --evidence, --tdx-quote, --snp-report or --azure-hcl, verify real-format evidence from files instead (offline; exit 0, or 3 naming
    the first claim that failed).
    """
    if sim_formats:
        from gputravel.console.cli.commands.attest_evidence import attest_sim_formats

        if evidence is not None or tdx_quote is not None or inject is not None:
            raise DataError("--sim-formats makes its own evidence: no --evidence, --tdx-quote or --inject with it")
        attest_sim_formats(state_dir=state_dir or default_state_dir(), out=out, json_out=json_out)
        return
    if out is not None:
        raise DataError("--out goes with --sim-formats")
    snp = snp_report is not None or azure_hcl is not None
    if snp:
        from gputravel.console.cli.commands.attest_snp import attest_snp

        if sum(x is not None for x in (evidence, tdx_quote, snp_report, azure_hcl)) > 1 or inject is not None:
            raise DataError("give one of --evidence, --tdx-quote, --snp-report, --azure-hcl (no --inject with them)")
        if cert_chain is not None or rim or collateral is not None:
            raise DataError("--cert-chain, --rim and --collateral do not go with --snp-report/--azure-hcl")
        if pccs_url is not None or rim_url is not None or ocsp_url is not None:
            raise DataError("--pccs-url goes with --tdx-quote, --rim-url and --ocsp-url with --evidence")
        attest_snp(snp_report=snp_report, azure_hcl=azure_hcl, vcek=vcek, tpm_quote=tpm_quote, nonce=nonce,
                   product=product, at=at, policy=policy, json_out=json_out, kds_url=kds_url, offline=offline,
                   report_data=report_data)
        return
    if vcek is not None or tpm_quote is not None or product is not None or kds_url is not None:
        raise DataError("--vcek, --kds-url, --tpm-quote and --product need --snp-report or --azure-hcl")
    if evidence is not None or tdx_quote is not None:
        from gputravel.console.cli.commands.attest_evidence import attest_gpu_evidence, attest_tdx_quote

        if evidence is not None and tdx_quote is not None:
            raise DataError("give --evidence (GPU) or --tdx-quote (CVM), one at a time")
        if inject is not None:
            raise DataError("--inject applies to the emulated attestation only")
        if evidence is not None:
            if report_data is not None:
                raise DataError("--report-data goes with --snp-report/--tdx-quote; a GPU report's is --nonce")
            if pccs_url is not None:
                raise DataError("--pccs-url goes with --tdx-quote")
            attest_gpu_evidence(evidence=evidence, cert_chain=cert_chain, nonce=nonce, rims=rim or [], at=at,
                                policy=policy, json_out=json_out, rim_url=rim_url, offline=offline,
                                ocsp_url=ocsp_url)
        else:
            assert tdx_quote is not None
            if rim_url is not None or ocsp_url is not None:
                raise DataError("--rim-url and --ocsp-url go with --evidence")
            attest_tdx_quote(quote=tdx_quote, collateral=collateral, at=at, policy=policy, json_out=json_out,
                             pccs_url=pccs_url, offline=offline, report_data=report_data)
        return
    if any(v is not None for v in (cert_chain, nonce, rim, collateral, at, pccs_url, rim_url, offline, ocsp_url,
                                   report_data)):
        raise DataError("--cert-chain, --nonce, --rim, --collateral, --at, --pccs-url, --rim-url, --ocsp-url, "
                        "--report-data and --offline need --evidence or --tdx-quote")
    fault = inject.value if inject is not None else None
    result = run_emulated_attestation(
        state_dir or default_state_dir(),
        inject=fault,
        policy=load_policy(policy) if policy is not None else None,
    )
    if json_out:
        typer.echo(json.dumps(result_json(result, inject=fault), indent=2, ensure_ascii=False))
    else:
        render(Console(), result, inject=fault)
    if not result.ok:
        raise typer.Exit(code=AttestationError.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``attest`` to the CLI."""
    app.command("attest")(attest)
