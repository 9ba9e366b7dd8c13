"""``gputravel agents deploy|status|stop --holders-file F``: the holders over SSH."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from shlex import quote
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gputravel.core.errors import AgentError, GpuTravelError

#: a row in one of these states is fine (exit 0)
OK_STATES = ("verified", "stopped", "holder-pinned")
agents_app = typer.Typer(help="Deploy, check and stop holder agents over SSH.", no_args_is_help=True)


def stop_command(name: str) -> str:
    """``pkill`` for the agents of holder ``name`` only (``--name NAME`` matched whole, regex characters
    escaped). The pattern starts with a bracket class so that the remote shell running pkill, whose own
    command line holds the pattern's text, does not match it and is not killed with the agents."""
    name_re = "".join("\\" + c if c in ".[\\()*+?{|^$" else c for c in name)
    return f"pkill -f -- {quote(f'[g]putravel[.]agents[.]holder --name {name_re}( |$)')}"


async def _for_each(path: Path, action: str) -> list[dict[str, Any]]:
    from gputravel.agents.deploy import bundle_dir, connect, deploy, remote_hash, run_remote
    from gputravel.agents.holder import agent_sha256
    from gputravel.agents.inventory import load_inventory

    specs = load_inventory(path)
    want = agent_sha256()

    async def one(spec: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"holder": spec.name, "host": spec.host, "port": spec.port, "user": spec.user}
        if not spec.managed:
            return {**row, **(await _pinned(spec, action))}
        try:
            conn = await connect(spec)
        except AgentError as exc:
            return {**row, "state": "offline", "reason": exc.reason}
        try:
            folder = bundle_dir(spec, want)
            if action == "deploy":
                rep = await deploy(conn, spec)
                row.update(state="verified", bundle_sha256=rep.bundle_sha256, uploaded=rep.uploaded,
                           remote_dir=rep.remote_dir, cryptography=rep.cryptography, seconds=round(rep.seconds, 3))
            elif action == "status":
                have = await remote_hash(conn, spec, folder)
                row.update(state="verified" if have == want else ("stale" if have else "not deployed"),
                           bundle_sha256=have, expected=want, remote_dir=folder)
            else:  # stop: end this holder's running agents and remove nothing else
                res = await run_remote(conn, spec, stop_command(spec.name), timeout=30)  # failures: AgentError, below
                if res.exit_status not in (0, 1):  # pkill: 0 some matched, 1 none did, else an error
                    return {**row, "state": "failed",
                            "reason": f"pkill failed (exit {res.exit_status}): {str(res.stderr).strip()[-200:]}"}
                row.update(state="stopped", exit_status=res.exit_status, was_running=res.exit_status == 0)
            return row
        except GpuTravelError as exc:
            return {**row, "state": "failed", "reason": exc.reason}
        finally:
            conn.close()

    return list(await asyncio.gather(*(one(s) for s in specs)))


async def _pinned(spec: Any, action: str) -> dict[str, Any]:
    """A holder-pinned holder (``managed = false``, issue 30): nothing is uploaded or stopped; deploy and status
    start its own ``holder serve`` once and report what its HELLO states (version, code SHA-256, policy digest)."""
    from gputravel.agents.ssh_holder import SshHolderLink

    if action == "stop":
        return {"state": "holder-pinned", "managed": False, "was_running": False,
                "reason": "its agent runs only while a run holds its connection: nothing to stop"}
    link = SshHolderLink(spec, max_reconnects=0)
    try:
        await link.start()
    except GpuTravelError as exc:
        return {"state": "failed", "managed": False, "reason": exc.reason}
    finally:
        await link.close()
    hello = link.session.hello
    assert hello is not None
    return {"state": "holder-pinned", "managed": False, "uploaded": False, "agent_version": hello.version,
            "bundle_sha256": hello.agent_sha256, "agent_sha256": hello.agent_sha256,
            "policy_sha256": hello.policy_sha256, "policy_source": hello.policy_source,
            "ignored": list(spec.ignored)}


def _render(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table()
    for col in ("holder", "host", "state", "bundle", "detail"):
        table.add_column(col)
    for r in rows:
        detail = r.get("reason") or (f"uploaded to {r['remote_dir']}" if r.get("uploaded") else r.get("remote_dir", ""))
        if r["state"] == "holder-pinned" and "policy_sha256" in r:
            detail = f"agent {r['agent_version']}, policy {str(r['policy_sha256'])[:16]} (the holder's own)"
        colour = {"verified": "green", "stopped": "cyan", "holder-pinned": "green"}.get(r["state"], "red")
        table.add_row(r["holder"], f"{r['host']}:{r['port']}", f"[{colour}]{r['state']}[/]",
                      (r.get("bundle_sha256") or "-")[:16], str(detail))
    Console().print(table)


def _exit_code(rows: list[dict[str, Any]]) -> int:
    return 0 if all(r["state"] in OK_STATES for r in rows) else AgentError.exit_code


def _make_command(action: str, doc: str) -> Any:
    def command(holders_file: Path = typer.Option(..., "--holders-file", help="Inventory (TOML)."),
                as_json: bool = typer.Option(False, "--json")) -> None:
        rows = asyncio.run(_for_each(holders_file, action))
        code = _exit_code(rows)
        if code and as_json:  # the one JSON error object, the holders' rows in it
            bad = [r for r in rows if r["state"] not in OK_STATES]
            error = AgentError(bad[0]["holder"], f"{bad[0]['state']}: {bad[0].get('reason') or '-'} "
                                                 f"({len(bad)} of {len(rows)} holders not {action}ed)")
            error.detail = {"holders": rows}
            raise error
        _render(rows, as_json)
        if code:
            raise typer.Exit(code)

    command.__doc__ = doc
    return command


def register(app: typer.Typer) -> None:
    for action, doc in (("deploy", "Upload the agent bundle where it is missing or changed, and verify it."),
                        ("status", "Connect to each holder and check its deployed bundle's hash."),
                        ("stop", "Stop running agents on each holder.")):
        agents_app.command(action)(_make_command(action, doc))
    app.add_typer(agents_app, name="agents")
