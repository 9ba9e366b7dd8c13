"""``gputravel holder``: a data holder's own side (issue 30): its configuration, its restricted key for the
orchestrator, the agent that key runs, and its receipts (docs/holders.md).

``init``/``show`` write and print the holder's configuration (``agents.holder.config``; init names each waiver it
wrote), ``policy show`` every check of its policy (``holder_policy``); ``serve`` is what the
key's forced command runs; ``authorize``/``revoke`` edit ``~/.ssh/authorized_keys``; ``receipts``/``verify`` list
the receipts its agent wrote and check them against a run's ledger, offline (exit 0, or 8 naming the first
difference). Every command runs as the holder's own user and touches only its own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gputravel.console.cli.commands.holder_policy import policy_app
from gputravel.core.errors import ConfigError, LedgerError

holder_app = typer.Typer(help="A data holder's own side: its configuration, restricted key and receipts.",
                         no_args_is_help=True)

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", metavar="DIR", help="The holder's configuration folder (default: $XDG_CONFIG_HOME/gputravel/holder, "
                                    "~/.config/gputravel/holder).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
holder_app.add_typer(policy_app, name="policy")


def register(app: typer.Typer) -> None:
    app.add_typer(holder_app, name="holder")


def _show(doc: dict[str, object], as_json: bool, *, title: str) -> None:
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for key, value in doc.items():
        text = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else \
            ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        table.add_row(key, text)
    Console().print(table)


@holder_app.command("init")
def init(
    data: Annotated[Path, typer.Option("--data", metavar="DIR", help="The holder's dataset folder.")],
    policy: Annotated[Path | None, typer.Option(
        "--policy", metavar="FILE", help="Evidence policy (default: the shipped one: NVIDIA's and Intel's roots). "
                                         "Its root certificate files are copied into the configuration.")] = None,
    golden: Annotated[Path | None, typer.Option(
        "--golden", metavar="FILE", help="The GPU's golden measurements this holder approved (JSON).")] = None,
    allow_conventional: Annotated[bool, typer.Option(
        "--allow-conventional", help="Accept conventional hand-offs (data then sealed to the attested CVM).")] = False,
    accept_any_td: Annotated[bool, typer.Option(
        "--accept-any-td", help="Accept a policy whose MRTD allow-list is empty: any TD image passes (every "
                                "verdict then says mr_td_policy any).")] = False,
    name: Annotated[str | None, typer.Option("--name", help="The holder's name (default: the login name).")] = None,
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Share of the data held out.")] = 0.1,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the holder's configuration: 0600 files in a 0700 folder (exit 2 when refused)."""
    from gputravel.agents.holder.config import init_config
    from gputravel.console.cli.commands.holder_policy import policy_rows, render_rows

    cfg = init_config(data=data, folder=config, name=name, policy=policy, golden=golden,
                      allow_conventional=allow_conventional, accept_any_td=accept_any_td, val_fraction=val_fraction)
    if not cfg.golden:
        typer.echo("gputravel: warning: no golden measurements (--golden): every GPU will fail measres", err=True)
    rows = policy_rows(cfg)
    loose = [r for r in rows if r["status"] in ("waived", "not checked")]
    if as_json:  # what was written, with each waiver and each check that accepts any value, and how to tighten it
        doc: dict[str, object] = {**cfg.to_dict(), "waivers": [r for r in loose if r["status"] == "waived"],
                                  "not_checked": [r for r in loose if r["status"] == "not checked"]}
        typer.echo(json.dumps(doc, indent=2))
        return
    _show(cfg.to_dict(), False, title=f"holder configuration written to {cfg.folder}")
    render_rows(loose, title=f"written to {cfg.policy_path}: waivers, and checks that accept any value")
    Console().print("`gputravel holder policy show` lists every check of this policy", soft_wrap=True)


@holder_app.command("show")
def show(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Print the holder's configuration with its policy's SHA-256 and the pinned roots' fingerprints."""
    from gputravel.agents.holder.config import HolderConfig

    cfg = HolderConfig.load(config)
    _show(cfg.to_dict(), as_json, title=f"holder configuration ({cfg.folder})")


@holder_app.command("serve")
def serve(config: ConfigOpt = None) -> None:
    """The holder's agent on stdin/stdout (what the orchestrator key's forced command runs)."""
    from gputravel.agents.holder.agent import exit_now
    from gputravel.agents.holder.serve import serve as serve_agent

    exit_now(serve_agent(config))  # not through the interpreter's shutdown: the link's reader may still block


def _key_text(path: Path) -> str:
    try:
        return path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--key {path}: cannot read ({exc})") from None


@holder_app.command("authorize")
def authorize(
    key: Annotated[Path, typer.Option("--key", metavar="ORCH_KEY.pub", help="The orchestrator's public key.")],
    data_forward: Annotated[bool, typer.Option(
        "--data-forward", help="Let the key listen on this machine's loopback only: the direct data path's "
                               "forward (the inventory's data_route = \"forward\", its default) needs it; without "
                               "it use data_route = \"network\" or the channel path.")] = False,
    permit_open: Annotated[str | None, typer.Option(
        "--permit-open", metavar="HOST:PORT", help="Let the key open local forwards to this one address (gputravel "
                                                   "itself needs none); listening as with --data-forward.")] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add one restricted authorized_keys line: restrict, a forced `holder serve`, loopback forwards if asked."""
    from gputravel.agents.holder.authorize import authorize as add
    from gputravel.agents.holder.config import HolderConfig, default_config_dir

    folder = (config or default_config_dir()).expanduser().resolve()
    HolderConfig.load(folder)  # a key only for a holder whose configuration serves
    path, line, replaced = add(_key_text(key), config_dir=folder, permit_open=permit_open, data_forward=data_forward)
    _show({"authorized_keys": str(path), "line": line, "replaced": replaced}, as_json, title="key authorized")


@holder_app.command("revoke")
def revoke(
    key: Annotated[Path, typer.Option("--key", metavar="ORCH_KEY.pub", help="The orchestrator's public key.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove the key's lines from authorized_keys (exit 2 if it had none)."""
    from gputravel.agents.holder.authorize import revoke as remove

    path, removed = remove(_key_text(key))
    _show({"authorized_keys": str(path), "removed": removed}, as_json, title="key revoked")


@holder_app.command("receipts")
def receipts(config: ConfigOpt = None, run: Annotated[str | None, typer.Option(
        "--run", help="Only this run's receipts.")] = None, as_json: JsonOpt = False) -> None:
    """List the receipts the holder's agent wrote, one per hand-off."""
    from gputravel.agents.holder.config import HolderConfig
    from gputravel.agents.holder.receipts import read_receipts

    cfg = HolderConfig.load(config)
    try:
        found = read_receipts(cfg.receipts, run)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rows = [{"file": str(p), "run": r.get("run"), "epoch": r.get("epoch"), "key_fp": r.get("key_fp"),
             "path": r.get("path"), "chunks": r.get("chunks"), "bytes": r.get("bytes"),
             "ok": (r.get("verdict") or {}).get("ok"), "policy_sha256": (r.get("verdict") or {}).get("policy_sha256"),
             "ledger_head": r.get("ledger_head")} for p, r in found]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"receipts in {cfg.receipts}", title_justify="left")
    for col in ("run", "epoch", "key", "path", "bytes", "verdict", "ledger head"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["run"]), str(r["epoch"]), str(r["key_fp"]), str(r["path"]), f"{r['bytes']:,}",
                      "ok" if r["ok"] else "refused", str(r["ledger_head"] or "-")[:24])
    Console().print(table)


@holder_app.command("verify")
def verify(
    ledger: Annotated[str, typer.Option(
        "--ledger", metavar="LEDGER_OR_RUN", help="A copy of the run's ledger (in a folder you can write: SQLite "
                                                  "puts its shared-memory file beside it), or its run folder.")],
    receipt: Annotated[list[Path] | None, typer.Argument(
        metavar="[RECEIPT ...]", help="Receipt files (default: the holder's own for the ledger's run).")] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check receipts against a run's ledger, offline: exit 0, or 8 naming the first difference."""
    from gputravel.agents.holder.config import HolderConfig
    from gputravel.agents.holder.receipts import WITNESS_NAME, check_run_id, read_receipt, read_receipts
    from gputravel.agents.receipts_check import verify_receipts
    from gputravel.console.cli.commands.ledger import ledger_address
    from gputravel.core.ledger import read_rows, witnessed_heads

    if not ledger:
        raise ConfigError("--ledger LEDGER_OR_RUN is required")
    where = ledger_address(ledger).ledger
    rows = read_rows(where, limit=1)
    run_id = rows[0].run_id if rows else None
    witness: list[tuple[int, str]] = []
    try:
        if receipt:
            found = [(p, read_receipt(p)) for p in receipt]
        else:
            cfg = HolderConfig.load(config)
            if run_id is None:
                raise LedgerError(f"{where}: an empty ledger names no run")
            found = read_receipts(cfg.receipts, check_run_id(run_id))
            wfile = cfg.receipts / run_id / WITNESS_NAME
            if wfile.is_file():
                witness = witnessed_heads(wfile, run_id=run_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    result = verify_receipts(where, found, witness)
    if not result.ok:
        raise LedgerError(f"receipts do not match the ledger: {result.difference}. Keep this copy of the ledger and "
                          f"your receipts as they are (they are your evidence), and ask the orchestrator's operator "
                          f"for the run's ledger as written (`gputravel ledger verify` names the first broken row)")
    for warning in result.warnings:
        typer.echo(f"gputravel: warning: {warning}", err=True)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    Console().print(f"[green]receipts match[/]: {result.receipts} receipt(s) of run {result.run_id} "
                    f"({result.holder} in the ledger, epochs {', '.join(map(str, result.epochs))}); chain intact, "
                    f"{result.rows} rows", soft_wrap=True)
