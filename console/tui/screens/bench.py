"""The Bench screen: run a benchmark in a worker (``gputravel bench NAME --json``), see a table and bars."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from rich.console import Group, JustifyMethod
from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import DataTable, OptionList, Static
from textual.widgets.option_list import Option

from gputravel.console.tui.bench_args import BENCH_ARGS
from gputravel.console.tui.screens.base import ConsoleScreen
from gputravel.console.tui.screens.bench_tables import BENCHES, BenchView, bench_view, progress_line
from gputravel.console.tui.widgets.bar_chart import BarChart
from gputravel.console.tui.widgets.table_filter import TableFilter, row_matches
from gputravel.console.tui.widgets.text import esc

#: Columns preferred for the bar chart, best first.
BAR_KEYS = ("speedup", "mb_s", "gb_s", "throughput", "throughput_mb_s", "tokens_per_s", "ms", "seconds", "s")

BenchRunner = Callable[[str, Callable[[str], None]], Awaitable[Any]]


@runtime_checkable
class BenchHost(Protocol):
    """What the screen reads of the console app that shows it (another app, a test's, has neither)."""

    bench_runner: BenchRunner | None

    @property
    def readonly(self) -> bool: ...
#: The bench screen of a replay: what it cannot do, and where the results are (a recording holds none).
REPLAY_NOTE = ("[$warning]a replay shows a recorded run: benchmarks cannot run here[/]\n[$text-muted]this "
               "recording holds no benchmark results (a run records none); `gputravel bench NAME` runs one, "
               "or a live gputravel-console with enter[/]")


def bench_available(name: str) -> bool:
    return importlib.util.find_spec(f"gputravel.console.cli.commands.bench_{name}") is not None


async def run_bench_subprocess(name: str, on_line: Callable[[str], None]) -> Any:
    """``gputravel bench NAME --json`` (plus ``BENCH_ARGS[NAME]``) in a child process: its rich progress bars
    (drawn to the pipe as to a terminal: ``TTY_COMPATIBLE``, ``TTY_INTERACTIVE``) as progress lines, stdout
    parsed as JSON."""
    env = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "100"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gputravel.console.cli", "bench",
                                                name.replace("_", "-"),  # gpu_aes is `bench gpu-aes`
                                                *BENCH_ARGS.get(name, ()), "--json", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None

    seen: list[str] = []

    async def progress() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(4096):
            line = progress_line(chunk.decode(errors="replace"))
            if line:
                seen.append(line)
                on_line(line)

    reader = asyncio.create_task(progress())
    try:
        out = await proc.stdout.read()
        code = await proc.wait()
    except asyncio.CancelledError:
        proc.kill()
        raise
    finally:
        await asyncio.gather(reader, return_exceptions=True)
    if code != 0:  # the CLI's own error (its JSON error object on stdout, else its last stderr line)
        try:
            reason = json.loads(out.decode())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = seen[-1] if seen else ""
        raise RuntimeError(f"gputravel bench {name} exited {code}" + (f": {reason}" if reason else ""))
    return json.loads(out.decode() or "null")


def result_rows(result: Any) -> list[dict[str, Any]]:
    """The rows of a benchmark's JSON: a list of objects, or the first such list inside it, or key/value pairs."""
    if isinstance(result, list) and all(isinstance(r, dict) for r in result):
        return list(result)
    if isinstance(result, dict):
        for key in ("results", "rows", "runs", "variants", "cases"):
            if isinstance(result.get(key), list) and all(isinstance(r, dict) for r in result[key]):
                return list(result[key])
        for value in result.values():
            if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
                return value
        return [{"metric": k, "value": v} for k, v in result.items() if not isinstance(v, dict | list)]
    return []


def chart_of(rows: list[dict[str, Any]]) -> tuple[tuple[tuple[str, float], ...], str]:
    """Bars for the best numeric column, labelled by the first text column(s)."""
    if not rows:
        return (), ""
    numeric = [k for k in rows[0] if all(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool)
                                         for r in rows)]
    key = next((k for k in BAR_KEYS if k in numeric), numeric[0] if numeric else None)
    if key is None:
        return (), ""
    text = [k for k in rows[0] if isinstance(rows[0][k], str)]
    bars = tuple((" ".join(str(r.get(k, "")) for k in text[:2]) or str(i), float(r[key])) for i, r in enumerate(rows))
    return bars, key


class BenchScreen(ConsoleScreen):
    """Pick a benchmark, enter runs it in a worker; ``x`` stops it."""

    SCREEN_NAME = "bench"
    AUTO_FOCUS = "#bench-list"
    HELP = ("Benchmarks run as `gputravel bench NAME --json` in a child process (the console stays live), in a "
            "small configuration (BENCH_ARGS; `gputravel bench NAME` runs the full study); the progress line is the "
            "CLI's own bar. The result shows as the CLI's table, its notes, and a chart of the bench's headline "
            "figure; / keeps the rows that match (every cell whole).")
    BINDINGS = [Binding("enter", "run_bench", "Run bench"), Binding("x", "stop_bench", "Stop bench")]

    def __init__(self, runner: BenchRunner | None = None) -> None:
        super().__init__()
        self.runner: BenchRunner = runner or run_bench_subprocess
        self.result_name: str | None = None
        self.result: Any = None
        self._filled_with = ""
        self.replay = False  # a recorded run on screen: nothing runs from here (its keys leave the footer)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("run_bench", "stop_bench") and self.replay:
            return False
        return True

    def show_state(self, state: Any, context: dict[str, Any]) -> None:
        if bool(context.get("replay")) != self.replay:
            self.replay = bool(context.get("replay"))
            self.refresh_bindings()
            if self.replay and self.result_name is None:
                self.query_one("#bench-status", Static).update(REPLAY_NOTE)
        if self.needle != self._filled_with and self.result_name is not None:
            self.show_result(self.result_name, self.result)

    def on_mount(self) -> None:
        self.add_class("-hide-log")  # the run's log says nothing of a benchmark: room for the table (o shows it)
        if isinstance(self.app, BenchHost) and self.app.bench_runner is not None:
            self.runner = self.app.bench_runner

    def compose_body(self) -> Iterable[Widget]:
        options = [Option(f"{name:<10} " + ("[$success]ready[/]" if bench_available(name) else
                                            "[$text-disabled]not installed yet[/]"), id=name)
                   for name, _ in BENCHES]
        yield Horizontal(
            OptionList(*options, id="bench-list"),
            Vertical(Static("[$text-muted]select a benchmark, enter runs it[/]", id="bench-status"),
                     Static(id="bench-progress"), id="bench-side"),
            id="bench-top")
        yield TableFilter(placeholder="filter result rows (enter keeps, escape clears)", id="bench-filter")
        yield DataTable(id="bench-table", zebra_stripes=True)
        yield Static(id="bench-notes")
        yield BarChart(id="bench-chart")

    def selected(self) -> str | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return None
        return ol.get_option_at_index(ol.highlighted).id

    @on(OptionList.OptionHighlighted)
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        desc = dict(BENCHES).get(event.option.id or "", "")
        if not self.workers or not any(w.group == "bench" and w.is_running for w in self.workers):
            hint = ("benchmarks are not run in a replay" if self.replay else "enter runs it · x stops it")
            self.query_one("#bench-status", Static).update(f"[b]{esc(event.option.id)}[/b]: {esc(desc)}\n"
                                                           f"[$text-muted]{hint}[/]")

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.action_run_bench()

    def action_run_bench(self, name: str | None = None) -> None:
        if self.replay:
            self.query_one("#bench-status", Static).update(REPLAY_NOTE)
            return
        if isinstance(self.app, BenchHost) and self.app.readonly:
            self.query_one("#bench-status", Static).update(
                "[$warning]read-only console: benchmarks are not started from here[/]")
            return
        name = name or self.selected() or BENCHES[0][0]
        if self.runner is run_bench_subprocess and not bench_available(name):
            self.query_one("#bench-status", Static).update(
                f"[$warning]bench {esc(name)} is not installed yet[/] (console/cli/commands/bench_{esc(name)}.py)")
            return
        self.run_bench(name)

    def action_stop_bench(self) -> None:
        self.workers.cancel_group(self, "bench")
        self.query_one("#bench-status", Static).update("[$warning]stopped[/]")

    @work(exclusive=True, group="bench", exit_on_error=False)
    async def run_bench(self, name: str) -> None:
        status = self.query_one("#bench-status", Static)
        progress = self.query_one("#bench-progress", Static)
        lines: list[str] = []

        def on_line(line: str) -> None:
            lines.append(line)
            progress.update("[$text-muted]" + esc(lines[-1]) + "[/]")

        status.update(f"[b $accent]running[/] {esc(name)}…")
        try:
            result = await self.runner(name, on_line)
        except Exception as exc:  # a failed benchmark is a message, not a crash
            status.update(f"[$error]bench {esc(name)} failed:[/] {esc(exc)}")
            return
        self.show_result(name, result)

    def show_result(self, name: str, result: Any) -> None:
        """The CLI's table for this bench (every cell whole; ``/`` keeps rows, never cuts a cell), its notes,
        and a chart of its headline figure; a result of another shape as a generic table."""
        self.result_name, self.result, self._filled_with = name, result, self.needle
        view = bench_view(name, result) or generic_view(result)
        rows = [r for r in view.rows if row_matches(self.needle, (c.plain for c in r))]
        table = self.query_one("#bench-table", DataTable)
        table.clear(columns=True)
        for i, col in enumerate(view.columns):
            width = max([len(col), *(r[i].cell_len for r in view.rows if i < len(r))])  # all rows, kept or not
            justify: JustifyMethod = view.justify[i] if i < len(view.justify) else "left"
            table.add_column(Text(col, justify=justify), key=f"c{i}", width=width)
        for r in rows:
            table.add_row(*r)
        self.query_one("#bench-notes", Static).update(Group(*view.notes) if view.notes else "")
        chart = self.query_one(BarChart)
        chart.unit = view.unit
        chart.bars = view.bars
        kept = f" ({len(rows)} match {esc(self.needle)}; escape clears)" if self.needle else ""
        self.query_one("#bench-progress", Static).update("")
        self.query_one("#bench-status", Static).update(
            f"[$success]done[/] {esc(name)}: {len(view.rows)} rows{kept}"
            + (f", bars: {esc(view.unit)}" if view.unit else "") + (f"\n[b]{esc(view.title)}[/b]" if view.title else ""))


def generic_view(result: Any) -> BenchView:
    """A result no CLI table knows: its rows as they come, the best numeric column charted."""
    every = result_rows(result)
    columns = list(dict.fromkeys(k for r in every for k in r))
    bars, key = chart_of(every)
    return BenchView(columns=columns, rows=[[Text(_cell(r.get(c))) for c in columns] for r in every],
                     bars=bars, unit=key)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"  # a large figure whole, never 5.306e+07
    if isinstance(value, dict):  # whole, never a JSON text cut to a width (53057940 read as 53057)
        return " ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value)
    return "" if value is None else str(value)
