"""``gputravel bench travel``: the Travelling-vs-conventional transfer study (``core.bench.travel``), wired:
options, the holder set that runs each training run, a progress bar, the table or ``--json``."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from gputravel.console.cli.commands.bench import StudyProgress
from gputravel.core.errors import ConfigError, GpuTravelError


def travel_progress(console: Console) -> StudyProgress:
    """The travel study's bar: which buffer and path, visits done of those expected."""
    return StudyProgress(TextColumn("{task.description:<30}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("visits"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)


# --- the screen --------------------------------------------------------------------------------------------
def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    job = result["job"]
    table = Table(title=f"bench travel: {job['holders']} holders × {job['holder_mib']:g} MiB, {job['model']} model, "
                        f"batch {job['batch_size']}×{job['seq_len']}, {job['steps_per_mib']:g} steps/MiB "
                        f"({result['seconds']:.0f} s)")
    for col in ("buffer MiB", "path", "visits", "steps", "train s", "transfer s", "transfer %", "Tx ms/visit",
                "fixed ms", "MB/s", "of bound", "conv/trav tx"):
        table.add_column(col, justify="left" if col in ("path",) else "right")
    from gputravel.core.bench import travel  # the engine: when a table is drawn, not for --help

    rat = result.get("ratios", {})
    for r in result["rows"]:
        buf = travel.label(r["buffer_mib"])
        if r["status"] != "ok":
            table.add_row(buf, r["path"], f"[yellow]{r['status']}[/]: {r['reason']}", *[""] * 9)
            continue
        ratio = rat.get(str(r["buffer_mib"]), {}).get("tx_conventional_over_travelling") \
            if r["path"] == "conventional" else None
        table.add_row(buf, r["path"], str(r["visits"]), str(r["steps"]), _f(r["train_s"], ".2f"),
                      _f(r["tx_s"], ".3f"), _f(r["tx_pct"], ".2f"),
                      _f(None if r.get("tx_s_per_visit") is None else 1e3 * r["tx_s_per_visit"], ".2f"),
                      _f(fixed_stages(r)[1].get("total"), ".2f"), _f(r["mb_s"], ",.0f"),
                      _f(r.get("fraction_of_bound"), ".2f"), "" if ratio is None else f"{ratio:.1f}x")
    console.print(table)
    console.print(f"transfer % = transfer / (transfer + training); {job['steps_rule']}. Tx ms/visit: a visit's "
                  "transfer; fixed ms: its hand-off's fixed cost (median, visits after each holder's first); of "
                  "bound: the row's bytes at bench provision's data-phase rate over its transfer time.")
    bars = [r for r in result["rows"] if r["status"] == "ok" and fixed_stages(r)[1].get("total")]
    if bars:
        console.print(stage_bars(bars))


#: each stage's colour in the bars (``core.travel.handoff.FIXED_STAGES``, then the data phase)
STAGE_STYLES = {"window": "cyan", "attest": "magenta", "verdict": "bright_magenta", "admission": "yellow",
                "ring_bind": "bright_yellow", "first_chunk": "blue", "done": "red", "data": "green"}


def fixed_stages(row: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The row's median fixed cost by stage, ms: over visits after each holder's first where there are any
    (a holder's first opens its data connection), else over every visit."""
    later = row.get("handoff_fixed_ms_later") or {}
    if later.get("total"):
        return "later visits", later
    return "every visit", row.get("handoff_fixed_ms") or {}


def stage_bars(rows: list[dict[str, Any]], width: int = 60) -> Table:
    """Where a visit's hand-off goes, stage by stage: one bar per row, every bar on one scale (ms)."""
    from gputravel.core.bench import travel

    spans = [(r, *fixed_stages(r)) for r in rows]
    longest = max(sum(st.get(k, 0.0) for k in STAGE_STYLES) for _, _, st in spans) or 1.0
    grid = Table(title="A hand-off's fixed cost and data phase, ms (medians; goal: fixed <= 2 ms)",
                 title_justify="left", box=None, show_header=False, pad_edge=False)
    grid.add_column(justify="right")
    grid.add_column()
    grid.add_column(justify="right")
    for r, over, st in spans:
        bar = Text()
        for stage, style in STAGE_STYLES.items():
            cells = round(width * st.get(stage, 0.0) / longest)
            bar.append("█" * cells, style=style)
        grid.add_row(f"{travel.label(r['buffer_mib'])} MiB {r['path']}", bar,
                     f"fixed {st.get('total', 0.0):.2f} + data {st.get('data', 0.0):.2f} ({over})")
    legend = Text("  ").join(Text(f"█ {stage}", style=style) for stage, style in STAGE_STYLES.items())
    grid.add_row("", legend, "")
    return grid


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("travel")
    def travel_cmd(
        buffer_mib: str = typer.Option("4,20,100,500,uncapped", "--buffer-mib",
                                       help="Buffer sizes in MiB, comma-separated; 'uncapped': a holder's whole "
                                            "data in one buffer."),
        dataset_mib: float | None = typer.Option(None, "--dataset-mib", help="MiB of data per holder (default: "
                                                 "max(8, 1.25 × the largest buffer that runs))."),
        holders: int = typer.Option(2, "--holders"),
        steps_per_mib: float = typer.Option(4.0, "--steps-per-mib",
                                            help="Training steps per MiB of training data in a visit."),
        model: str = typer.Option("tiny", "--model"),
        batch_size: int = typer.Option(8, "--batch-size"),
        seq_len: int = typer.Option(64, "--seq-len"),
        chunk_kib: int = typer.Option(1024, "--chunk-kib"),
        transport: str = typer.Option("ssh", "--transport", help="ssh (embedded loopback server) or local."),
        max_mib: float | None = typer.Option(None, "--max-mib", help="Skip buffers above this size."),
        torch_threads: int = typer.Option(1, "--torch-threads", help="Training threads (0: torch's default)."),
        conventional_fixes: bool = typer.Option(False, "--conventional-fixes",
                                                help="Give the conventional path parallel authentication and "
                                                     "overlap too."),
        attest_prefetch: bool = typer.Option(True, "--attest-prefetch/--no-attest-prefetch",
                                             help="The next holder attests while a visit trains (the run's "
                                                  "default); off: each hand-off attests in line (the before "
                                                  "of docs/performance.md)."),
        handoff_relay: bool = typer.Option(False, "--handoff-relay/--no-handoff-relay",
                                           help="The device also relays each attested HANDOFF on the agent's "
                                                "parked data connection (a trial, off like the run's default: "
                                                "measured no faster, docs/performance.md); off: the HANDOFF "
                                                "crosses the holder's SSH link only."),
        handoff_with_window: bool = typer.Option(True, "--handoff-with-window/--no-handoff-with-window",
                                                 help="A visit's first HANDOFF goes with its window's request "
                                                      "and the device writes it on the agent's parked data "
                                                      "connection as the window opens (the default; needs the "
                                                      "attestation prefetched; docs/performance.md); off: the "
                                                      "HANDOFF crosses the holder's SSH link after the window."),
        grant_at_completion: bool = typer.Option(True, "--grant-at-completion/--no-grant-at-completion",
                                                 help="The window's request that carries the HANDOFF is answered "
                                                      "when the window is complete (its grant and WindowClosed in "
                                                      "one answer) and the holder's DONE is read after, off the "
                                                      "path (the default: measured faster, docs/performance.md "
                                                      "\"Session 14\"); off: the grant comes back at once and a "
                                                      "hand-off ends on DONE."),
        paths: str = typer.Option("travelling,conventional", "--paths",
                                  help="Which paths to run, comma-separated (travelling, conventional): "
                                       "'travelling' alone measures the Tx share without the conventional run."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    ) -> None:
        """Travelling vs conventional: training time, transfer time and transfer % per buffer size."""
        from gputravel.core.bench import (
            travel,  # the planner and the engine: when the study runs, not for --help
        )
        from gputravel.core.sizes import parse_buffer_list

        try:
            buffers = parse_buffer_list(buffer_mib)
        except ConfigError as exc:
            raise typer.BadParameter(exc.reason, param_hint="--buffer-mib") from None
        from gputravel.core import planner

        chosen = tuple(p.strip() for p in paths.split(",") if p.strip())
        if not chosen or any(p not in planner.PATHS for p in chosen) or len(set(chosen)) != len(chosen):
            raise typer.BadParameter(f"paths are some of {', '.join(planner.PATHS)}, each once", param_hint="--paths")
        if transport not in ("ssh", "local"):
            raise typer.BadParameter("transport is ssh or local", param_hint="--transport")
        for name, value in (("--dataset-mib", dataset_mib), ("--max-mib", max_mib)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise typer.BadParameter("must be a positive number", param_hint=name)
        from gputravel.console import holders as holder_set
        from gputravel.console.entries import ENTRIES

        with tempfile.TemporaryDirectory(prefix="gputravel-bench-travel-") as tmp, \
                travel_progress(Console(stderr=True)) as progress:
            try:
                result = travel.study(buffers, workdir=Path(tmp), run=holder_set.run, dataset_mib=dataset_mib,
                                      holders=holders, steps_per_mib=steps_per_mib, model=model,
                                      batch_size=batch_size, seq_len=seq_len, chunk_kib=chunk_kib,
                                      transport=transport, max_mib=max_mib, torch_threads=torch_threads,
                                      conventional_fixes=conventional_fixes, on_progress=progress, entries=ENTRIES,
                                      attest_prefetch=attest_prefetch, handoff_relay=handoff_relay,
                                      handoff_with_window=handoff_with_window,
                                      grant_at_completion=grant_at_completion, paths=chosen)
            except ConfigError as exc:
                raise typer.BadParameter(exc.reason) from None
        statuses = {r["status"] for r in result["rows"]}
        if "failed" in statuses and "ok" not in statuses:  # nothing was measured: say so in the exit status
            if as_json:  # the one JSON error object, the study's result in it
                error = GpuTravelError("every run of the study failed (see each row's reason)")
                error.detail = result
                raise error
            render(result)
            Console(stderr=True).print("[red]every run of the study failed[/] (see each row's reason)")
            raise typer.Exit(1)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            render(result)
