"""``gputravel attest`` on AMD SEV-SNP evidence, offline: a raw SNP report, or Azure's HCL report with a TPM quote.

``--snp-report FILE --vcek FILE [--product milan|genoa|turin] [--at UNIX] [--policy P]`` checks a report against
its VCEK and AMD's pinned ARK/ASK; ``--azure-hcl FILE --vcek FILE --tpm-quote FILE --nonce HEX`` checks Azure's
form (the SNP report inside the HCL report, the runtime data it binds, the quote by the vTPM key over the nonce).
Exit 0 when every check holds, 3 (``AttestationError``) naming the first that failed, 2 for unreadable input or a
bad policy file.
"""

from __future__ import annotations

import re
from pathlib import Path

from cryptography import x509
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.console.cli.commands.attest_evidence import (
    finish_verdict,
    read_evidence,
    report_data_arg,
    verified_at,
)
from gputravel.core.errors import ConfigError, DataError
from gputravel.core.evidence.bounded import EvidenceTooLarge
from gputravel.core.evidence.policy import PolicyError, SnpPolicy, load_evidence_policy
from gputravel.core.evidence.snp import SnpVerdict

__all__ = ["attest_snp"]


def _policy(path: Path | None) -> SnpPolicy:
    try:
        return load_evidence_policy(path).snp
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc


def _nonce(text: str) -> bytes:
    clean = text.strip().removeprefix("0x")
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2}){1,64}", clean):
        raise DataError(f"--nonce must be 1 to 64 bytes as hex digits (got {len(clean)} characters)")
    return bytes.fromhex(clean)


def _kds_vcek(report: bytes, product: str | None, kds_url: str, offline: Path | None) -> bytes:
    """The VCEK for the report's chip id and TCB from AMD's KDS (or the bundle)."""
    from gputravel.console.cli.commands.evidence_fetch import cache_for, fetched
    from gputravel.core.evidence.bounded import read_hex_or_raw
    from gputravel.core.evidence.services import fetch_vcek
    from gputravel.core.evidence.snp_report import SnpFormatError, parse_snp_report, product_of_cpuid

    try:
        parsed = parse_snp_report(read_hex_or_raw(report))
    except (SnpFormatError, EvidenceTooLarge):
        return b""  # the verdict names report-parsed
    chosen = product or product_of_cpuid(parsed.cpuid[0], parsed.cpuid[1])
    if chosen is None:
        raise DataError("--kds-url needs --product milan|genoa|turin for a version-2 report (it names no CPU)")
    cache = cache_for(offline)
    return fetched(lambda: fetch_vcek(kds_url, parsed, chosen, cache))


def _vcek_dates(cert: bytes) -> dict[str, str] | None:
    """The VCEK's subject, issuer and validity, as the verdict's ``vcek`` (None when it is not a certificate)."""
    from gputravel.core.evidence.bounded import read_hex_or_raw
    from gputravel.core.evidence.snp import load_certificate

    try:
        c = load_certificate(read_hex_or_raw(cert))
    except (ValueError, EvidenceTooLarge):
        return None

    def cn(name: x509.Name) -> str:
        attrs = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        return str(attrs[0].value) if attrs else name.rfc4514_string()

    return {"subject": cn(c.subject), "issuer": cn(c.issuer),
            "not_before": f"{c.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ}",
            "not_after": f"{c.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"}


def attest_snp(*, snp_report: Path | None, azure_hcl: Path | None, vcek: Path | None, tpm_quote: Path | None,
               nonce: str | None, product: str | None, at: int | None, policy: Path | None, json_out: bool,
               kds_url: str | None = None, offline: Path | None = None, report_data: str | None = None) -> None:
    """Verify SNP (or Azure HCL + TPM quote) evidence files; print the verdict; exit 0 or 3."""
    from gputravel.core.evidence.azure_snp import verify_azure_snp
    from gputravel.core.evidence.snp import verify_snp_report
    from gputravel.core.evidence.snp_report import PRODUCTS

    if (vcek is None) == (kds_url is None):
        raise DataError("--snp-report/--azure-hcl needs --vcek FILE (the chip's VCEK, DER or PEM) or --kds-url URL "
                        "(AMD's KDS), one of them")
    if product is not None and product not in PRODUCTS:
        raise DataError(f"--product must be one of {', '.join(PRODUCTS)} (got {product!r})")
    pol = _policy(policy)
    verdict: SnpVerdict
    if azure_hcl is not None:
        if report_data is not None:
            raise DataError("--report-data goes with --snp-report; Azure's report data is the hash of its runtime "
                            "data, and freshness is the TPM quote's --nonce")
        if tpm_quote is None or nonce is None:
            raise DataError("--azure-hcl needs --tpm-quote FILE and --nonce HEX (the nonce the quote must carry)")
        hcl = read_evidence(azure_hcl, "HCL report")
        cert = read_evidence(vcek, "VCEK") if vcek is not None else _kds_vcek(hcl[32:32 + 1184], product, str(kds_url),
                                                                     offline)
        verdict = verify_azure_snp(hcl, cert, read_evidence(tpm_quote, "TPM quote"), _nonce(nonce), product=product, now=at,
                                   policy=pol)
    else:
        assert snp_report is not None
        if tpm_quote is not None or nonce is not None:
            raise DataError("--tpm-quote and --nonce go with --azure-hcl (a raw SNP report's nonce is its report "
                            "data: --report-data HEX)")
        report = read_evidence(snp_report, "SNP report")
        cert = read_evidence(vcek, "VCEK") if vcek is not None else _kds_vcek(report, product, str(kds_url), offline)
        verdict = verify_snp_report(report, cert, product=product, now=at, policy=pol,
                                    expected_report_data=report_data_arg(report_data))
    doc = verdict.to_json()
    doc.update(failed_reason=verdict.reason or None, verified_at=verified_at(at), product=verdict.product,
               vcek=_vcek_dates(cert))

    def render() -> None:
        console = Console()
        table = Table(title=f"AMD SEV-SNP evidence ({verdict.platform}, offline)", title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        for key in ("verified_at", "product", "vcek", "measurement", "report_data", "reported_tcb", "chip_id",
                    "policy"):
            table.add_row(key, escape(str(doc[key])))
        for name, ok in verdict.checks.items():
            table.add_row(name, "[green]✓[/]" if ok else "[bold red]✗[/]")
        for name, why in verdict.not_checked.items():
            table.add_row(name, f"[yellow]–[/] not checked: {escape(why)}")
        console.print(table)
        console.print(f"verdict: {'[bold green]PASS[/]' if verdict.ok else '[bold red]FAIL[/]'}")

    finish_verdict(doc, json_out=json_out, console_render=render, failed_reason=verdict.reason)
