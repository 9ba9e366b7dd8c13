"""``gputravel bench hostile``: the wiring (options, the table); the study is ``gputravel.core.bench.hostile``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gputravel.console.entries import ENTRIES


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("hostile")
    def hostile_cmd(
        connections: int = typer.Option(40, "--connections", min=1, max=512,
                                         help="Hostile connections per listener of the device."),
        size_mib: int = typer.Option(256, "--size-mib", min=1,
                                     help="Bytes per hand-off (64 MiB hand-offs last ~20 ms: too short to compare)."),
        chunk_kib: int = typer.Option(1024, "--chunk-kib", min=1),
        visits: int = typer.Option(10, "--visits", min=1, help="Hand-offs per sitting."),
        path: str = typer.Option("direct-tcp", "--path", help="direct-tcp (the TCP data port) or direct."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Provisioning with and without hostile local users on every port the device listens on.

        A quiet sitting and one with hostile local users (uid nobody when root): provisioning rates, their ratio,
        visits completed, rejections charged to honest holders."""
        if path not in ("direct-tcp", "direct"):
            raise typer.BadParameter("--path must be direct-tcp or direct")
        from gputravel.core.bench.hostile import hostile_study  # the engine: when it runs, not for --help

        with tempfile.TemporaryDirectory(prefix="gputravel-hostile-") as tmp:
            result = hostile_study(connections=connections, size_mib=size_mib, chunk_kib=chunk_kib,
                                   handoffs=visits, workdir=Path(tmp), entries=ENTRIES, path=path)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result)


def render(result: dict[str, Any], console: Console | None = None) -> None:
    """The table ``bench hostile`` prints (the console's bench screen shows the same)."""
    table = Table(title=f"bench hostile: {result['connections']} connections per listener, {result['visits']} × "
                        f"{result['size_mib']} MiB on {result['path']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k in ("quiet_mb_s", "hostile_mb_s", "ratio", "visits_completed", "misattributed_rejections"):
        table.add_row(k, str(result[k]))
    table.add_row("refused before admission", json.dumps(result["hostile"]["refused_before_admission"]))
    (console or Console()).print(table)
