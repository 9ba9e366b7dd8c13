"""What the bench screen shows of a result: the CLI's own tables and a chart of the bench's headline figure.

The tables are not copied: each ``console/cli/commands/bench_<name>.py`` renders its result with rich (its
``render`` function, ``render_load``, ``render_soak``, ``render_ablation``); here that function prints into
a :class:`CapturedConsole`, which keeps what it was given (tables, notes) instead of writing it. The first
table becomes the screen's data table (its cells exactly as the CLI prints them), the rest the notes below it.
:data:`HEADLINES` picks, per bench, the figure its chart plots (``allreduce``: the median time per call of each
variant and size, never ``world_size``).
"""

from __future__ import annotations

import importlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["BENCHES", "HEADLINES", "BenchView", "CapturedConsole", "bench_view", "progress_line"]

#: (name, what it measures): every benchmark ``gputravel bench`` offers (console/cli/commands/bench.py).
BENCHES: tuple[tuple[str, str], ...] = (
    ("provision", "holder → GPU provisioning MB/s per data path, next to one AES-GCM core"),
    ("allreduce", "plain vs secure ring all-reduce variants: median time per call"),
    ("travel", "travelling vs conventional transfer at 4 and 20 MiB buffers (the full study: gputravel bench "
               "travel)"),
    ("ddp", "DDP training with the secure communication hook: time per iteration"),
    ("load", "many holders at once: deploy time, protocol overhead per visit"),
    ("soak", "a long run: memory growth and overhead drift"),
    ("gpu_aes", "AES-256-GCM on the GPU: seal and open GB/s per message size"),
    ("fleet", "a fleet of GPUs: tokens/s and scaling, sealed vs plain all-reduce"),
    ("checkpoint", "sealed checkpoint: seal + write and restore MB/s, peak memory"),
    ("train", "the protocol's training loop against a plain torch loop: tokens/s"),
    ("evidence", "checking GPU (SPDM + RIMs) and CVM (TDX quote) evidence: ms per check"),
    ("hostile", "provisioning with 40 hostile local connections on every device port, against a quiet run"),
    ("fleet_key", "a fleet's key agreement: attested CVM quotes checked by every worker, ms to every worker's key"),
)

#: (module, function, result first?) of each bench's CLI table.
RENDERERS: dict[str, tuple[str, str, bool]] = {
    "provision": ("bench_provision", "render", True), "allreduce": ("bench_allreduce", "render", False),
    "travel": ("bench_travel", "render", True), "ddp": ("bench_ddp", "render", False),
    "load": ("bench_load", "render_load", True), "soak": ("bench_soak", "render_soak", True),
    "gpu_aes": ("bench_gpu_aes", "render", False), "fleet": ("bench_fleet", "render", True),
    "checkpoint": ("bench_checkpoint", "render", True), "train": ("bench_train", "render", True),
    "evidence": ("bench_evidence", "render", True), "hostile": ("bench_hostile", "render", True),
    "fleet_key": ("bench_fleet_key", "render", True),
}


class CapturedConsole(Console):
    """A rich console that keeps what it is asked to print (a table stays a table)."""

    def __init__(self, width: int = 160) -> None:
        super().__init__(file=io.StringIO(), width=width, color_system=None)
        self.items: list[RenderableType] = []

    def print(self, *objects: Any, **kwargs: Any) -> None:
        for obj in objects:
            self.items.append(Text.from_markup(obj) if isinstance(obj, str) else obj)


def cli_renderables(name: str, result: Any) -> list[RenderableType]:
    """What ``gputravel bench NAME`` prints for ``result`` (empty when the result is not that bench's)."""
    module_name, func, result_first = RENDERERS.get(name, ("", "", True))
    if not module_name or not isinstance(result, dict):
        return []
    if name == "provision" and result.get("benchmark") == "provision-ablation":
        func = "render_ablation"
    try:
        render: Callable[..., None] = getattr(importlib.import_module(f"gputravel.console.cli.commands.{module_name}"),
                                              func)
        console = CapturedConsole()
        render(result, console) if result_first else render(console, result)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
        return []  # a result of another shape (a bench of a newer version, a test's): the generic view
    return console.items


def cell_text(cell: Any, justify: JustifyMethod = "left") -> Text:
    text = cell.copy() if isinstance(cell, Text) else (Text.from_markup(cell) if isinstance(cell, str)
                                                       else Text(str(cell)))
    text.justify = justify
    return text


@dataclass
class BenchView:
    """A result as the screen shows it: a title, the table (header and whole cells), notes, a chart."""

    title: str = ""
    columns: list[str] = field(default_factory=list)
    rows: list[list[Text]] = field(default_factory=list)
    justify: list[JustifyMethod] = field(default_factory=list)  # per column, as the CLI aligns it
    notes: list[RenderableType] = field(default_factory=list)
    bars: tuple[tuple[str, float], ...] = ()
    unit: str = ""


def bench_view(name: str, result: Any) -> BenchView | None:
    """The CLI's table and this bench's headline chart; None when the result is not this bench's."""
    items = cli_renderables(name, result)
    table = next((i for i in items if isinstance(i, Table)), None)
    if table is None:
        return None
    view = BenchView(title=str(table.title or ""), columns=[str(c.header) for c in table.columns])
    columns = [list(c.cells) for c in table.columns]
    justify = [c.justify for c in table.columns]  # figures right-aligned, as the CLI prints them
    view.justify = justify
    view.rows = [[cell_text(col[i], j) for col, j in zip(columns, justify, strict=True)] for i in range(table.row_count)]
    view.notes = [i for i in items if i is not table]
    headline = HEADLINES.get(name)
    if headline is not None:
        try:
            view.bars, view.unit = headline(result)
        except (KeyError, TypeError, ValueError, IndexError):
            view.bars, view.unit = (), ""
    return view


# --- the headline figure of each bench -------------------------------------------------------------------
Bars = tuple[tuple[tuple[str, float], ...], str]


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("note") and r.get("status", "ok") == "ok"]


def _provision(r: dict[str, Any]) -> Bars:
    if r.get("benchmark") == "provision-ablation":
        return tuple((x["config"], float(x["gb_s"])) for x in r["rows"]), "GB/s"
    return tuple((x["path"], float(x["mb_s"])) for x in r["rows"]), "MB/s (median hand-off)"


def _allreduce(r: dict[str, Any]) -> Bars:
    sizes = {x["size_mib"] for x in r["rows"]}
    worlds = {x["world_size"] for x in r["rows"]}

    def label(x: dict[str, Any]) -> str:
        parts = [x["variant"] + (f"/{x['gather']}" if x.get("gather") and x["gather"] != "sealed" else "")]
        if len(sizes) > 1:
            parts.append(f"{x['size_mib']:g} MiB")
        if len(worlds) > 1:
            parts.append(f"×{x['world_size']}")
        return " ".join(parts)

    return tuple((label(x), x["median_s"] * 1e3) for x in _ok(r["rows"])), "ms per call (median, lower is better)"


def _ddp(r: dict[str, Any]) -> Bars:
    return tuple((f"{x['variant']} ×{x['world_size']}", x["median_s"] * 1e3) for x in r["rows"]), "ms per iteration"


def _travel(r: dict[str, Any]) -> Bars:
    return (tuple((f"{x['buffer_mib']} MiB {x['path']}", float(x["tx_pct"])) for x in _ok(r["rows"])),
            "% of the time spent transferring")


def _load(r: dict[str, Any]) -> Bars:
    return (tuple((p, float(ms)) for p, ms in r["per_visit"]["overhead_by_phase_median_ms"].items()),
            "ms protocol overhead per visit, by phase (median)")


def _soak(r: dict[str, Any]) -> Bars:
    return (tuple((f"decile {i + 1}", float(x)) for i, x in enumerate(r["overhead"]["by_decile_median_ms"])),
            "ms protocol overhead per visit (median of each tenth of the run)")


def _gpu_aes(r: dict[str, Any]) -> Bars:
    measured = [x for x in r["rows"] if x.get("open_gb_s") is not None]  # the simulator measures no GB/s
    return tuple((f"{x['size_bytes'] / 1024:g} KiB", float(x["open_gb_s"])) for x in measured), "GB/s open"


def _fleet(r: dict[str, Any]) -> Bars:
    return tuple((f"{x['gpus']} GPUs {x['variant']}", float(x["tokens_per_s"])) for x in _ok(r["rows"])), "tokens/s"


def _checkpoint(r: dict[str, Any]) -> Bars:
    return (("seal + write", float(r["seal_mb_s"])), ("read + open + load", float(r["restore_mb_s"])),
            ("AES-GCM, 1 core", float(r["aes_gcm_1core_mb_s"]))), "MB/s"


def _train(r: dict[str, Any]) -> Bars:
    p = r["protocol"]
    return (("run (all phases)", float(p["tokens_per_s"])), ("run (TRAIN)", float(p["train_phase_tokens_per_s"])),
            ("plain torch", float(r["plain"]["tokens_per_s"]))), "tokens/s"


def _evidence(r: dict[str, Any]) -> Bars:
    return tuple((name, float(t["median_ms"])) for name, t in r["timings"].items()), "median ms"


def _hostile(r: dict[str, Any]) -> Bars:
    return (("quiet", float(r["quiet_mb_s"])), ("hostile", float(r["hostile_mb_s"]))), "MB/s"


def _fleet_key(r: dict[str, Any]) -> Bars:
    return tuple((f"run {i}", float(ms)) for i, ms in enumerate(r["fleet_ms_all"], 1)), "ms to every worker's key"


HEADLINES: dict[str, Callable[[dict[str, Any]], Bars]] = {
    "provision": _provision, "allreduce": _allreduce, "ddp": _ddp, "travel": _travel, "load": _load,
    "soak": _soak, "gpu_aes": _gpu_aes, "fleet": _fleet, "checkpoint": _checkpoint, "train": _train,
    "evidence": _evidence, "hostile": _hostile, "fleet_key": _fleet_key,
}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def progress_line(chunk: str) -> str:
    """The newest line of a rich progress display written to a pipe (its refreshes are separated by
    carriage returns and cursor moves): the last non-blank one, escapes removed."""
    parts = [p.strip() for p in re.split(r"[\r\n]", _ANSI.sub("", chunk))]
    return next((p for p in reversed(parts) if p), "")
