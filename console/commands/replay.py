"""``gputravel replay FILE``: a recorded run, headless (the console plays it with ``--replay``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gputravel.console.view_model import RunState
from gputravel.core.recording import load_recording


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_cmd(
        path: Annotated[Path, typer.Argument(help="A recording (SQLite) written by gputravel-console.",
                                             show_default=False)],
        as_json: Annotated[bool, typer.Option("--json", help="Print meta, events, telemetry and a summary.")] = False,
        events_only: Annotated[bool, typer.Option("--events", help="Only the events (with --json).")] = False,
    ) -> None:
        """Print a recorded run: every event and telemetry frame, and the state it ends in."""
        recording = load_recording(path)
        state = RunState()
        for event in recording.events():
            state.apply(event)
        if as_json:
            out = recording.to_dict()
            if events_only:
                out = {"events": out["events"]}
            else:
                out["summary"] = state.summary()
            typer.echo(json.dumps(out, indent=2))
            return
        console = Console()
        frames = sum(1 for i in recording.items if i.kind == "telemetry")
        console.print(f"[bold]{escape(str(path))}[/]: {len(recording.items) - frames} events, {frames} telemetry "
                      f"frames; run {state.run_id or '?'} [bold]{state.status}[/]")
        for line in state.oplog:
            style = {"warn": "yellow", "error": "red"}.get(line.level, "")
            console.print(f"[{style}]{escape(line.render())}[/]" if style else escape(line.render()))
