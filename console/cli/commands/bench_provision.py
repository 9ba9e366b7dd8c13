"""``gputravel bench provision``: the wiring (options, progress, tables); the study itself is
``gputravel.core.bench.provision``, whose hand-offs are the engine's own hand-off code."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gputravel.console.cli.commands.bench_load import ssh_holders
from gputravel.console.cli.options import CipherEngine
from gputravel.console.entries import ENTRIES

#: table column -> the report's stage key
STAGE_COLUMNS = {"fixed": "fixed_s", "seal": "read_seal_s", "wait": "wait_s", "open": "open_s", "H2D": "h2d_s"}


def _ticker(progress: Progress) -> Callable[[str, int], Callable[[], None]]:
    """A progress task per measured configuration; the function advances it."""

    def new_task(label: str, total: int) -> Callable[[], None]:
        task = progress.add_task(label, total=total)
        return lambda: progress.advance(task)

    return new_task


def _run(study: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """One study in a temporary folder, over the loopback SSH server (or local agents), with its progress
    bars on stderr."""
    with tempfile.TemporaryDirectory(prefix="gputravel-bench-") as tmp, \
            Progress(console=Console(stderr=True), transient=True) as progress:
        return study(*args, workdir=Path(tmp), server=ssh_holders, entries=ENTRIES,
                     progress=_ticker(progress), **kwargs)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("provision")
    def provision_cmd(
        path: list[str] = typer.Option(["direct", "ssh"], "--path", help="direct (same host: the shared-memory "
                                       "ring; shm names it), direct-socket (frames on the device's Unix socket), "
                                       "direct-tcp (the TCP data port, reached over the network), direct-tcp-forward (the same "
                                       "port through the holder's SSH port forward), ssh (chunks inside the SSH channel), "
                                       "local (agent subprocess over a pipe), conventional; comma list or "
                                       "repeated."),
        size_mib: int = typer.Option(64, "--size-mib", min=1, help="Bytes provisioned per hand-off (MiB)."),
        chunk_kib: int = typer.Option(1024, "--chunk-kib", min=1),
        repeats: int = typer.Option(3, "--repeats", min=1),
        ablate: bool = typer.Option(False, "--ablate", help="Fastrack-style table: each optimisation on/off, "
                                    "the conventional path and a plain memory copy."),
        cipher_engine: CipherEngine = typer.Option(CipherEngine.AUTO, "--cipher-engine", help="Who opens the "
                                                   "chunks on the device (as `gputravel run --cipher-engine`)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """End-to-end provisioning MB/s per data path, next to the single-core AES-GCM rate."""
        from gputravel.core.bench.provision import (  # the engine: when it runs, not for --help
            PATHS,
            paths_study,
        )

        if ablate:
            _ablate(size_mib=size_mib, chunk_kib=chunk_kib, repeats=repeats, as_json=as_json)
            return
        paths = [p for item in path for p in item.split(",") if p]
        for p in paths:
            if p not in PATHS:
                raise typer.BadParameter(f"unknown path {p!r}; choose from {', '.join(PATHS)}")
        result = _run(paths_study, paths, size_mib=size_mib, chunk_kib=chunk_kib, repeats=repeats,
                      cipher_engine=cipher_engine.value)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        render(result)


def render(result: dict[str, Any], console: Console | None = None) -> None:
    """The paths table and its ceilings (the console's bench screen shows the same)."""
    console = console or Console()
    rows = result["rows"]
    aes = result["aes_gcm_1core_mb_s"] * 1e6
    size_mib, chunk_kib = rows[0]["size_mib"] if rows else "?", rows[0]["chunk_kib"] if rows else "?"
    table = Table(title=f"provisioning {size_mib} MiB per hand-off, {chunk_kib} KiB chunks "
                        f"(AES-256-GCM 1 core: {aes / 1e6:,.0f} MB/s)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("path", "MB/s", "best", "core", "ring", *STAGE_COLUMNS, "by"):
        table.add_column(col, justify="left" if col in ("path", "by") else "right", no_wrap=True)
    for r in rows:
        st = {**r["stages"], "fixed_s": r["fixed_s"]}
        table.add_row(r["path"], f"{r['mb_s']:,.0f}", f"{r['best_mb_s']:,.0f}",
                      f"{r['fraction_of_aes_core']:.0%}", f"{r['fraction_of_ring_pipeline']:.0%}",
                      *(f"{st[k] * 1e3:.1f}" for k in STAGE_COLUMNS.values()),
                      (r.get("cipher_engine") or "?").split(" ")[0])
    console.print(table)
    console.print("MB/s: median hand-off (best: the fastest); core: share of one AES-GCM core; ring: share of "
                  "the bare ring pipeline's median below; fixed: ms per hand-off outside the data phase (the "
                  "link's HANDOFF and DONE, set-up, ring bind); seal, wait, open, H2D: ms per hand-off, summed "
                  "over threads (stages overlap; the largest binds); by: who opened the chunks")
    pair, ring = result["aes_gcm_pair_mb_s"], result["ring_pipeline_mb_s"]
    console.print(f"ceilings: a bare seal -> ring -> open pipeline (two processes, no protocol) runs at "
                  f"{ring['median']:,.0f} MB/s, {ring['best']:,.0f} at best "
                  f"({result['ring_pipeline_of_aes_core']:.0%} of one core); one seal and one open pass at "
                  f"once at {pair['seal']:,.0f} / {pair['open']:,.0f} MB/s; a memory copy at "
                  f"{result['memcpy_mb_s']:,.0f} MB/s")
    if "direct_vs_ssh" in result:
        console.print(f"direct / ssh: {result['direct_vs_ssh']}x")
    share = result["device_aes_vs_standalone"]
    device_aes = result["aes_gcm_in_device_mb_s"] * 1e6
    verdict = ("nothing there holds the GIL" if share >= 0.9 else
               "[yellow]something in that process competes for the GIL[/]")
    console.print(f"AES-GCM inside the device process: {device_aes / 1e6:,.0f} MB/s, {share:.0%} of the "
                  f"standalone rate: {verdict}")


def _ablate(*, size_mib: int, chunk_kib: int, repeats: int, as_json: bool) -> None:
    from gputravel.core.bench.provision import ablation_study

    result = _run(ablation_study, size_mib=size_mib, chunk_kib=chunk_kib, repeats=repeats)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    render_ablation(result)


def render_ablation(result: dict[str, Any], console: Console | None = None) -> None:
    rows = result["rows"]
    aes, copy = result["aes_gcm_1core_gb_s"] * 1e9, result["memcpy_gb_s"] * 1e9
    size_mib, chunk_kib, repeats = result["size_mib"], result["chunk_kib"], result["repeats"]
    table = Table(title=f"provisioning ablation: {size_mib} MiB per hand-off, {chunk_kib} KiB chunks, "
                        f"median of {repeats} (AES-GCM 1 core {aes / 1e9:.2f} GB/s, memcpy {copy / 1e9:.2f} GB/s)")
    for col in ("configuration", "GB/s", "of 1 AES core", "vs conventional", "time saved"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in rows:
        table.add_row(r["config"], f"{r['gb_s']:.2f}", f"{r['fraction_of_aes_core']:.0%}",
                      f"{r['speedup_vs_conventional']:.2f}x", f"{r['time_saved_vs_conventional_pct']:.0f}%")
    (console or Console()).print(table)
