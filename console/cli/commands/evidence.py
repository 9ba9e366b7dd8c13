"""``gputravel evidence bundle``: fetch the collateral some evidence needs (TDX collateral from a PCCS, a VCEK from
AMD's KDS, RIMs from NVIDIA's RIM service) into the user cache and copy it, with each entry's expiry, into a
folder an air-gapped holder carries in (``gputravel attest ... --offline DIR``)."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Annotated

import typer

from gputravel.console.cli.commands.evidence_fetch import cache_for, fetched
from gputravel.core.errors import DataError

__all__ = ["register"]

evidence_app = typer.Typer(help="Collateral for offline attestation: fetch what evidence needs and bundle it for an air-gapped holder.", no_args_is_help=True)


@evidence_app.command("bundle")
def bundle(
    out: Annotated[Path, typer.Option("--out", help="The bundle folder to write (made if missing).")],
    tdx_quote: Annotated[Path | None, typer.Option("--tdx-quote", help="A TDX quote: bundle its collateral.")] = None,
    pccs_url: Annotated[str | None, typer.Option("--pccs-url", help="PCCS or PCS (API v4) for --tdx-quote.")] = None,
    snp_report: Annotated[Path | None, typer.Option("--snp-report", help="An SEV-SNP report: bundle its VCEK.")] = None,
    kds_url: Annotated[str | None, typer.Option("--kds-url", help="AMD's KDS for --snp-report.")] = None,
    product: Annotated[str | None, typer.Option("--product", help="milan, genoa or turin (for --snp-report).")] = None,
    evidence: Annotated[Path | None, typer.Option("--evidence", help="A GPU report: bundle its two RIMs.")] = None,
    rim_url: Annotated[str | None, typer.Option("--rim-url", help="NVIDIA's RIM service for --evidence.")] = None,
    at: Annotated[int | None, typer.Option("--at", help="Fetch as of this Unix time (default: now).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Fetch (through the cache) and bundle the collateral of the evidence given."""
    from gputravel.core.evidence.bounded import EvidenceTooLarge, read_hex_or_raw
    from gputravel.core.evidence.bounded import read_capped as capped

    def read_capped(path: Path, *, what: str) -> bytes:
        try:
            return capped(path, what=what)
        except EvidenceTooLarge as exc:
            raise DataError(str(exc)) from exc
        except OSError as exc:
            raise DataError(f"{path}: cannot read the {what} ({exc.strerror})") from exc

    cache = cache_for(None)
    if not any((tdx_quote, snp_report, evidence)):
        raise DataError("give --tdx-quote (with --pccs-url), --snp-report (with --kds-url) or --evidence (with "
                        "--rim-url)")
    if tdx_quote is not None:
        from gputravel.core.evidence.services import fetch_tdx_collateral

        if pccs_url is None:
            raise DataError("--tdx-quote needs --pccs-url")
        quote = read_capped(tdx_quote, what="TDX quote")
        fetched(lambda: fetch_tdx_collateral(pccs_url, quote, cache, now=at))
    if snp_report is not None:
        from gputravel.core.evidence.services import fetch_vcek
        from gputravel.core.evidence.snp_report import SnpFormatError, parse_snp_report

        if kds_url is None or product is None:
            raise DataError("--snp-report needs --kds-url and --product")
        try:
            report = parse_snp_report(read_hex_or_raw(read_capped(snp_report, what="SNP report")))
        except SnpFormatError as exc:
            raise DataError(f"{snp_report}: {exc}") from exc
        fetched(lambda: fetch_vcek(kds_url, report, product, cache, now=at))
    if evidence is not None:
        from gputravel.core.evidence.nvidia_spdm import EvidenceFormatError, parse_report
        from gputravel.core.evidence.nvidia_spdm import read_hex_or_raw as spdm_hex
        from gputravel.core.evidence.services import fetch_rim, rim_ids

        if rim_url is None:
            raise DataError("--evidence needs --rim-url")
        try:
            gpu = parse_report(spdm_hex(read_capped(evidence, what="GPU report")))
        except EvidenceFormatError as exc:
            raise DataError(f"{evidence}: {exc}") from exc
        for rid in rim_ids(dict(gpu.opaque), gpu.driver_version, gpu.vbios_version):
            fetched(functools.partial(fetch_rim, rim_url, rid, cache, now=at))
    lines = fetched(lambda: cache.export(out, list(cache.touched), now=at if at is not None else time.time()))
    doc = {"out": str(out), "entries": lines}
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
    else:
        for line in lines:
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(line["expires"])))
            typer.echo(f"{line['key']}  (expires {expires})")
        typer.echo(f"{len(lines)} entries in {out}: gputravel attest ... --offline {out}")


def register(app: typer.Typer) -> None:
    """Add ``evidence`` (with ``bundle``) to the CLI."""
    app.add_typer(evidence_app, name="evidence")
