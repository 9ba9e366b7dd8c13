"""``gputravel attest``: attest the (emulated) GPU and show every claim."""

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
from gputravel.core.errors import AttestationError


def default_state_dir() -> Path:
    """Where the emulated vendor PKI and device identity live between runs."""
    return Path(platformdirs.user_state_dir("gputravel")) / "emulated"


def cipher_engine() -> dict[str, str]:
    """Which engine a device service started here would seal/open the data path with (``auto``)."""
    from gputravel.core.device.openers import describe_choice

    label, reason = describe_choice("auto")
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
        Path | None, typer.Option("--policy", help="Attestation policy TOML (default: the shipped one).")
    ] = None,
) -> None:
    """Attest the GPU: certificate chain, revocation, signature, nonce, measurements, CC mode."""
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
