"""``gputravel fleet pki export FILE``: the emulated vendors' PKI of a multi-node fleet, as one file (SIM only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

fleet_app = typer.Typer(name="fleet", help="A fleet over several nodes (docs/fleet.md).", no_args_is_help=True)
pki_app = typer.Typer(name="pki", help="SIM: the emulated vendors' PKI every node of a fleet trusts.",
                      no_args_is_help=True)
fleet_app.add_typer(pki_app, name="pki")


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")


@pki_app.command("export")
def export(
    file: Annotated[Path, typer.Argument(dir_okay=False, help="Where to write it (0600; an existing file is refused).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """SIM only: write the emulated vendors' PKI (GPU and TDX) as FILE, to carry to every node of a fleet.

    Then `gputravel run --gpus N --nnodes H --sim-pki FILE` on each node. Real GPUs and CVMs use their vendors'
    own chains."""
    from gputravel.core.fleet.pki import export_sim_pki

    done = export_sim_pki(file)
    if as_json:
        typer.echo(json.dumps(done, indent=2))
        return
    Console().print(f"[bold]SIM[/] vendor PKI written to {done['path']} (emulated GPU vendor + SIM TDX; holds "
                    f"their SIM private keys, 0600). Not for real hardware: real GPUs and CVMs arrive certified "
                    f"by their vendors. Carry it to each node: gputravel run --gpus N --nnodes H --sim-pki FILE",
                    highlight=False)
