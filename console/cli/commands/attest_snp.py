"""``gputravel attest`` on AMD SEV-SNP evidence, offline: a raw SNP report, or Azure's HCL report with a TPM quote.

``--snp-report FILE --vcek FILE [--product milan|genoa|turin] [--at UNIX] [--policy P]`` checks a report against
its VCEK and AMD's pinned ARK/ASK; ``--azure-hcl FILE --vcek FILE --tpm-quote FILE --nonce HEX`` checks Azure's
form (the SNP report inside the HCL report, the runtime data it binds, the quote by the vTPM key over the nonce).
Exit 0 when every check holds, 3 (``AttestationError``) naming the first that failed, 2 for unreadable input or a
bad policy file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.core.errors import AttestationError, ConfigError, DataError
from gputravel.core.evidence.bounded import EvidenceTooLarge, read_capped
from gputravel.core.evidence.policy import PolicyError, SnpPolicy, load_evidence_policy
from gputravel.core.evidence.snp import SnpVerdict

__all__ = ["attest_snp"]


def _read(path: Path, what: str) -> bytes:
    try:
        return read_capped(path, what=what)
    except EvidenceTooLarge as exc:
        raise DataError(str(exc)) from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read the {what} ({exc.strerror})") from exc


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


def attest_snp(*, snp_report: Path | None, azure_hcl: Path | None, vcek: Path | None, tpm_quote: Path | None,
               nonce: str | None, product: str | None, at: int | None, policy: Path | None, json_out: bool) -> None:
    """Verify SNP (or Azure HCL + TPM quote) evidence files; print the verdict; exit 0 or 3."""
    from gputravel.core.evidence.azure_snp import verify_azure_snp
    from gputravel.core.evidence.snp import verify_snp_report
    from gputravel.core.evidence.snp_report import PRODUCTS

    if vcek is None:
        raise DataError("--snp-report/--azure-hcl needs --vcek FILE (the chip's VCEK, DER or PEM; from AMD's KDS)")
    if product is not None and product not in PRODUCTS:
        raise DataError(f"--product must be one of {', '.join(PRODUCTS)} (got {product!r})")
    pol = _policy(policy)
    verdict: SnpVerdict
    if azure_hcl is not None:
        if tpm_quote is None or nonce is None:
            raise DataError("--azure-hcl needs --tpm-quote FILE and --nonce HEX (the nonce the quote must carry)")
        verdict = verify_azure_snp(_read(azure_hcl, "HCL report"), _read(vcek, "VCEK"), _read(tpm_quote, "TPM quote"),
                                   _nonce(nonce), product=product, now=at, policy=pol)
    else:
        assert snp_report is not None
        if tpm_quote is not None or nonce is not None:
            raise DataError("--tpm-quote and --nonce go with --azure-hcl (a raw SNP report binds no nonce here)")
        verdict = verify_snp_report(_read(snp_report, "SNP report"), _read(vcek, "VCEK"), product=product, now=at,
                                    policy=pol)
    doc = verdict.to_json()
    if json_out:
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        console = Console()
        table = Table(title=f"AMD SEV-SNP evidence ({verdict.platform}, offline)", title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        for key in ("measurement", "report_data", "reported_tcb", "chip_id", "policy"):
            table.add_row(key, escape(str(doc[key])))
        for name, ok in verdict.checks.items():
            table.add_row(name, "[green]✓[/]" if ok else "[bold red]✗[/]")
        console.print(table)
        console.print(f"verdict: {'[bold green]PASS[/]' if verdict.ok else '[bold red]FAIL[/]'}")
    if not verdict.ok:
        Console(stderr=True).print(f"[bold red]attestation failed[/]: {escape(str(verdict.failed))}: "
                                   f"{escape(verdict.reason)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=AttestationError.exit_code)
