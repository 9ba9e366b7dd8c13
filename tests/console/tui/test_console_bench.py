"""The bench screen as tables and charts (issue 25.7): the CLI's own table for a bench's result, a chart of its
headline figure (allreduce: the median time per variant, never ``world_size``), all 10 benches, progress while
running, and a kept ``/`` filter that never cuts a cell.

The allreduce result is a real one (``gputravel bench allreduce --world-size 2 --size-mib 0.01,0.1 --repeats 3
--warmup 1 --json``, kept in tests/snapshots/console/bench-allreduce.json).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import SNAPSHOTS_DIR

from gputravel.console.cli.commands.bench import BENCH_MODULES
from gputravel.console.tui.app import GpuTravelConsole, make_app
from gputravel.console.tui.screens.bench import BenchScreen
from gputravel.console.tui.screens.bench_tables import BENCHES, bench_view, progress_line
from gputravel.console.tui.widgets.bar_chart import BarChart
from tests.console.tui.test_console_snapshots import check_snapshot, screen_text

ALLREDUCE = json.loads((SNAPSHOTS_DIR / "console" / "bench-allreduce.json").read_text())


def never_built() -> Any:
    raise AssertionError("the engine must not be built")


def runner_of(result: Any, progress: tuple[str, ...] = ()) -> Callable[[str, Callable[[str], None]], Any]:
    async def run(name: str, on_line: Callable[[str], None]) -> Any:
        for line in progress:
            on_line(line)
        return result
    return run


async def run_on_screen(app: GpuTravelConsole, pilot: Any, bench: str) -> None:
    await pilot.press("5")
    await pilot.pause()
    assert isinstance(app.screen, BenchScreen)
    app.screen.action_run_bench(bench)
    for worker in list(app.screen.workers):
        if worker.group == "bench":
            await worker.wait()
    await pilot.pause()


def test_the_screen_offers_every_bench_the_cli_offers() -> None:
    assert {name for name, _ in BENCHES} == set(BENCH_MODULES) and len(BENCHES) == 13


def test_allreduce_chart_plots_time_per_variant_not_world_size() -> None:
    view = bench_view("allreduce", ALLREDUCE)
    assert view is not None
    assert view.columns[:4] == ["world", "MiB", "variant", "gather"]  # the CLI's table, as `bench allreduce`
    medians = {(r["variant"], r["size_mib"]): r["median_s"] * 1e3 for r in ALLREDUCE["rows"]}
    assert dict(view.bars) == {f"{v} {s:g} MiB": ms for (v, s), ms in medians.items()}
    assert "ms per call" in view.unit
    assert len({value for _, value in view.bars}) > 1  # the old chart: every bar the world size, 2


def test_progress_line_is_the_newest_refresh_of_a_rich_bar() -> None:
    chunk = "\x1b[?25l\r\x1b[2K\x1b[1mworld 2\x1b[0m  0/4 0:00:00\r\x1b[2K\x1b[1mworld 2 · 1 MiB\x1b[0m ━━  2/4 0:00:01"
    assert progress_line(chunk) == "world 2 · 1 MiB ━━  2/4 0:00:01"


async def test_bench_screen_shows_the_cli_table_a_headline_chart_and_progress() -> None:
    app = make_app(engine_factory=never_built, record=False,
                   bench_runner=runner_of(ALLREDUCE, ("world 2 · 0.01 MiB ━━  2/4 0:00:01",)))
    async with app.run_test(size=(120, 40)) as pilot:
        await run_on_screen(app, pilot, "allreduce")
        text = screen_text(app)
        assert "done allreduce: 10 rows" in text and "Ring all-reduce: median per call" in text
        assert "secure_pipelined" in text and "median ms" in text and "× plain" in text
        chart = app.screen.query_one(BarChart)
        assert ("plain 0.1 MiB", ALLREDUCE["rows"][6]["median_s"] * 1e3) in chart.bars
        assert "machine:" in text, text  # the CLI's notes under its table
        check_snapshot("bench-allreduce", text)


async def test_a_kept_filter_never_cuts_a_cell(tmp_path: Path) -> None:
    # a result no CLI table knows (the generic view): a nested figure was cut to 40 characters of JSON
    result = {"results": [{"variant": "plain", "mb_s": 12.5, "stages": {"seal_s": 0.25, "wait_s": 0.5,
                                                                       "bytes": 53057940}},
                          {"variant": "secure", "mb_s": 3.0, "stages": {"seal_s": 0.5, "wait_s": 1.0, "bytes": 7}}]}
    app = make_app(engine_factory=never_built, record=False, bench_runner=runner_of(result))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        await pilot.pause()
        await pilot.press("slash", *"secure", "enter")  # a filter kept from before the result
        await pilot.pause()
        await run_on_screen(app, pilot, "provision")
        await pilot.press("escape")  # the filter goes: the wide row comes back, whole
        await pilot.pause()
        text = screen_text(app)
        assert "53057940" in text, text
        await pilot.press("slash", *"plain", "enter")
        await pilot.pause()
        text = screen_text(app)
        assert "53057940" in text and app.screen.query_one("#bench-table").row_count == 1, text


def test_every_bench_has_its_cli_table_renderer_and_a_headline() -> None:
    import importlib

    from gputravel.console.tui.screens.bench_tables import HEADLINES, RENDERERS

    for name, _ in BENCHES:
        module, func, _first = RENDERERS[name]
        assert callable(getattr(importlib.import_module(f"gputravel.console.cli.commands.{module}"), func)), name
        assert name in HEADLINES
