"""``gputravel replay RUN``: a recorded run, headless (the console plays it with ``--replay``).

``RUN`` is any run address (``core/runfolder/address.py``): a recording file, a run folder, a fleet folder (every
rank's recording, merged in time order), a run name or ``latest``. A fleet over nodes that share no folder: a
node's folder holds its own ranks, the output says which ranks ran on other nodes, and ``--node-folder DIR``
(repeatable: another node's folder or a copy of it) merges theirs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from gputravel.console.cli.output import out_console
from gputravel.core.runfolder import RUN_ADDRESS_HELP


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_cmd(
        run: Annotated[str, typer.Argument(help=RUN_ADDRESS_HELP, metavar="RUN", show_default=False)],
        as_json: Annotated[bool, typer.Option("--json", help="Print meta, events, telemetry and a summary.")] = False,
        events_only: Annotated[bool, typer.Option("--events", help="Only the events (with --json).")] = False,
        node_folders: Annotated[list[Path] | None, typer.Option(
            "--node-folder", metavar="DIR", help="A fleet over several nodes: another node's fleet folder (or a "
            "copy), whose ranks merge with this node's (repeatable).")] = None,
    ) -> None:
        """Print a recorded run: every event and telemetry frame, and the state it ends in."""
        from gputravel.console.view.model import RunState
        from gputravel.core.errors import ConfigError, RecordingError
        from gputravel.core.recording import load_recording
        from gputravel.core.runfolder import resolve_run

        try:
            address = resolve_run(run)
        except ConfigError as exc:  # what replay cannot read is a recording error, as a missing file always was
            raise RecordingError(f"{run}: no such recording or run ({exc.reason})") from None
        address = replace(address, nodes=tuple(node_folders or ()))
        nodes = address.fleet_nodes() if address.fleet or address.nodes else None
        sources = address.recordings()
        if not sources:
            raise RecordingError(f"{run}: no recording (the run was started with --no-record)")
        recordings = [(gpu, load_recording(path)) for gpu, path in sources]
        state = RunState()
        merged = sorted(((i.t, -1 if gpu is None else gpu, i.seq, gpu, i) for gpu, rec in recordings
                         for i in rec.items), key=lambda x: x[:3])
        for *_, gpu, item in merged:
            if item.kind == "event":
                state.apply(item.event(), gpu=gpu)
        if as_json:
            out: dict[str, Any]
            if len(recordings) == 1 and recordings[0][0] is None:
                out = recordings[0][1].to_dict()
            else:  # a fleet: each rank's recording, and the events of all merged (each with its gpu)
                out = {"path": str(address.folder), "fleet": True,
                       "meta": {str(gpu): rec.meta for gpu, rec in recordings},
                       "events": [{**i.body, "gpu": gpu} for *_, gpu, i in merged if i.kind == "event"],
                       "telemetry": [{**i.body, "gpu": gpu} for *_, gpu, i in merged if i.kind == "telemetry"],
                       "nodes": nodes.to_dict() if nodes is not None else None}
            if events_only:
                out = {"events": out["events"]}
            else:
                out["summary"] = state.summary()
            typer.echo(json.dumps(out, indent=2, default=str))
            return
        console = out_console()  # one event, one line: a pipe or a terminal wraps, not rich
        frames = sum(1 for *_, i in merged if i.kind == "telemetry")
        where = address.file or address.folder
        console.print(f"[bold]{escape(str(where))}[/]: {len(merged) - frames} events, {frames} telemetry "
                      f"frames; run {state.run_id or '?'} [bold]{state.status}[/]")
        if nodes is not None and (nodes.note() or nodes.given):
            console.print(nodes.note() or f"ranks {sorted(nodes.ranks)} merged from {len(nodes.given) + 1} nodes' "
                          "folders", highlight=False)
        for line in state.oplog:
            style = {"warn": "yellow", "error": "red"}.get(line.level, "")
            console.print(f"[{style}]{escape(line.stamped())}[/]" if style else escape(line.stamped()))
