"""``gputravel bench provision``: end-to-end provisioning throughput per data path.

Each measurement is one real hand-off: the emulated device service derives a window key, the holder's
agent (deployed over the loopback SSH server, or a local subprocess) seals its data in chunks and the
device authenticates and decrypts them straight into its buffer. Timed from HANDOFF to DONE. The
single-core AES-256-GCM decrypt rate is measured in the same run, with the same chunk size.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gputravel.core.machine import aes_gcm_rate, machine_info

PATHS = ("direct", "direct-tcp", "ssh", "local", "conventional")

#: The Fastrack-style ablation: (label, path, parallel_auth, overlap)
ABLATION = (
    ("travelling: direct + parallel auth + overlap", "direct", True, True),
    ("travelling: direct + overlap (no parallel auth)", "direct", False, True),
    ("travelling: direct only (serial receive/decrypt)", "direct", False, False),
    ("travelling over the SSH channel (no direct path)", "ssh", True, True),
    ("conventional: SSH + CPU re-encryption + device decrypt", "conventional", True, True),
)


def memcpy_rate(size: int, *, seconds: float = 0.3) -> float:
    """Plain host memory copy rate (bytes/s): the floor any path is compared with."""
    src = bytearray(os.urandom(1 << 20)) * (size >> 20 or 1)
    dst = bytearray(len(src))
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        memoryview(dst)[:] = src
        n += 1
    return n * len(src) / (time.perf_counter() - t0)


def make_dataset(folder: Path, nbytes: int) -> None:
    """A holder folder whose single .txt file holds ``nbytes`` of printable pseudo-random text."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.txt", "wb") as f:
        left = nbytes
        while left:
            block = os.urandom(min(left, 1 << 22) // 2 + 1).hex().encode()[: min(left, 1 << 22)]
            f.write(block)
            left -= len(block)


async def measure_path(path: str, *, size: int, chunk: int, repeats: int, workdir: Path,
                       progress: Any = None, task: Any = None, parallel_auth: bool | None = None,
                       overlap: bool | None = None, probe: dict[str, float] | None = None) -> list[float]:
    """Seconds per hand-off of ``size`` bytes on ``path`` (direct | direct-tcp | ssh | local | conventional).

    With ``probe``, also the AES-GCM rate measured inside the device process after the hand-offs
    (``probe["device_aes_b_s"]``): it falls if anything in that process holds the GIL (issue 5's check
    that the data path's process has no busy Python threads)."""
    from gputravel.agents.fleet import EmbeddedSshServer, links_from_specs
    from gputravel.core.device.client import DeviceClient
    from gputravel.core.platform.emulated import EmulatedPlatform
    from gputravel.core.travel.holders import Handoff, LocalHolderLink

    data = workdir / "holder" / "bench"
    if not data.exists():
        make_dataset(data, int(size / 0.9) + 64)  # the agent holds out 10% for validation
    handle = EmulatedPlatform(workdir / "platform").start(buffer_bytes=size)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors)
    server = None
    times: list[float] = []
    try:
        await asyncio.to_thread(client.connect)
        await asyncio.to_thread(client.call, "set_data_path", parallel_auth=parallel_auth, overlap=overlap)
        if path == "local":
            link: Any = LocalHolderLink("bench", data)
        else:
            server = EmbeddedSshServer([("bench", data)])
            link = links_from_specs(await asyncio.to_thread(server.start))[0]
        info = await link.start()
        if info.train_bytes < size:
            raise typer.BadParameter(f"dataset too small: {info.train_bytes} < {size}")
        endpoint = ({"host": handle.data_host, "port": handle.data_port} if path == "direct-tcp" else
                    {"path": handle.socket_path} if path == "direct" else None)
        for epoch in range(1, repeats + 1):
            head, _ = await asyncio.to_thread(client.call, "handoff", epoch=epoch, offset=0, length=size,
                                              chunk_size=chunk)
            handoff = Handoff(epoch=epoch, session_id=head["session_id"], key=head["provisioning_key"],
                              window_offset=0, chunk_size=chunk, train=(0, size), val=(0, 0),
                              conventional=path == "conventional")
            t0 = time.perf_counter()
            await link.provision(handoff, device_socket=handle.socket_path, data_endpoint=endpoint)
            times.append(time.perf_counter() - t0)
            closed, _ = await asyncio.to_thread(client.call, "close_window", epoch=epoch)
            if not closed["complete"] or closed["bytes"] != size:
                raise RuntimeError(f"incomplete hand-off on {path}: {closed}")
            if progress is not None:
                progress.advance(task)
        await link.close()
        if probe is not None:
            rate, _ = await asyncio.to_thread(client.call, "aes_rate", chunk=chunk)
            probe["device_aes_b_s"] = float(rate["bytes_per_s"])
    finally:
        if server is not None:
            server.stop()
        client.close()
        handle.stop()
    return times


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("provision")
    def provision_cmd(
        path: list[str] = typer.Option(["direct", "ssh"], "--path", help="direct, ssh (chunks inside the SSH "
                                       "channel), local (agent subprocess over a pipe); repeatable."),
        size_mib: int = typer.Option(64, "--size-mib", min=1, help="Bytes provisioned per hand-off (MiB)."),
        chunk_kib: int = typer.Option(1024, "--chunk-kib", min=1),
        repeats: int = typer.Option(3, "--repeats", min=1),
        ablate: bool = typer.Option(False, "--ablate", help="Fastrack-style table: each optimisation on/off, "
                                    "the conventional path and a plain memory copy."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """End-to-end provisioning MB/s per data path, next to the single-core AES-GCM rate."""
        if ablate:
            _ablate(size_mib=size_mib, chunk_kib=chunk_kib, repeats=repeats, as_json=as_json)
            return
        paths = [p for item in path for p in item.split(",") if p]
        for p in paths:
            if p not in PATHS:
                raise typer.BadParameter(f"unknown path {p!r}; choose from {', '.join(PATHS)}")
        size, chunk = size_mib << 20, chunk_kib << 10
        console = Console(stderr=True)
        rows = []
        with tempfile.TemporaryDirectory(prefix="gputravel-bench-") as tmp, \
                Progress(console=console, transient=True) as progress:
            aes = aes_gcm_rate(chunk)
            in_device: list[float] = []
            for p in paths:
                task = progress.add_task(f"{p}: {repeats} × {size_mib} MiB", total=repeats)
                probe: dict[str, float] = {}
                times = asyncio.run(measure_path(p, size=size, chunk=chunk, repeats=repeats, workdir=Path(tmp),
                                                 progress=progress, task=task, probe=probe))
                in_device.append(probe["device_aes_b_s"])
                med = statistics.median(times)
                rows.append({"path": p, "size_mib": size_mib, "chunk_kib": chunk_kib, "repeats": repeats,
                             "median_s": round(med, 6), "min_s": round(min(times), 6),
                             "mb_s": round(size / med / 1e6, 1), "best_mb_s": round(size / min(times) / 1e6, 1),
                             "fraction_of_aes_core": round(size / med / aes, 3)})
        by = {r["path"]: r for r in rows}
        device_aes = statistics.median(in_device)
        result = {"benchmark": "provision", "machine": machine_info(), "aes_gcm_1core_mb_s": round(aes / 1e6, 1),
                  # the same measurement inside the device service's process: a busy Python thread there
                  # would hold the GIL between AES-GCM calls and pull this below the standalone rate
                  "aes_gcm_in_device_mb_s": round(device_aes / 1e6, 1),
                  "device_aes_vs_standalone": round(device_aes / aes, 3),
                  "rows": rows}
        if "direct" in by and "ssh" in by:
            result["direct_vs_ssh"] = round(by["direct"]["mb_s"] / by["ssh"]["mb_s"], 2)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        table = Table(title=f"provisioning {size_mib} MiB per hand-off, {chunk_kib} KiB chunks "
                            f"(AES-256-GCM 1 core: {aes / 1e6:,.0f} MB/s)")
        for col in ("path", "median MB/s", "best MB/s", "of 1 AES core", "median s"):
            table.add_column(col, justify="right" if col != "path" else "left")
        for r in rows:
            table.add_row(r["path"], f"{r['mb_s']:,.0f}", f"{r['best_mb_s']:,.0f}",
                          f"{r['fraction_of_aes_core']:.0%}", f"{r['median_s']:.3f}")
        Console().print(table)
        if "direct_vs_ssh" in result:
            Console().print(f"direct / ssh: {result['direct_vs_ssh']}x")
        share = result["device_aes_vs_standalone"]
        verdict = ("nothing there holds the GIL" if share >= 0.9 else
                   "[yellow]something in that process competes for the GIL[/]")
        Console().print(f"AES-GCM inside the device process: {device_aes / 1e6:,.0f} MB/s, {share:.0%} of the "
                        f"standalone rate: {verdict}")


def _ablate(*, size_mib: int, chunk_kib: int, repeats: int, as_json: bool) -> None:
    size, chunk = size_mib << 20, chunk_kib << 10
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gputravel-bench-") as tmp, \
            Progress(console=console, transient=True) as progress:
        aes = aes_gcm_rate(chunk)
        copy = memcpy_rate(size)
        for label, p, par, ovl in ABLATION:
            task = progress.add_task(label, total=repeats)
            times = asyncio.run(measure_path(p, size=size, chunk=chunk, repeats=repeats, workdir=Path(tmp),
                                             progress=progress, task=task, parallel_auth=par, overlap=ovl))
            med = statistics.median(times)
            rows.append({"config": label, "path": p, "parallel_auth": par, "overlap": ovl,
                         "median_s": round(med, 6), "min_s": round(min(times), 6),
                         "gb_s": round(size / med / 1e9, 3), "fraction_of_aes_core": round(size / med / aes, 3)})
    base = next(r for r in rows if r["path"] == "conventional")
    for r in rows:
        r["speedup_vs_conventional"] = round(base["median_s"] / r["median_s"], 2)
        r["time_saved_vs_conventional_pct"] = round(100 * (1 - r["median_s"] / base["median_s"]), 1)
    result = {"benchmark": "provision-ablation", "machine": machine_info(), "size_mib": size_mib, "chunk_kib": chunk_kib,
              "repeats": repeats, "aes_gcm_1core_gb_s": round(aes / 1e9, 3), "memcpy_gb_s": round(copy / 1e9, 3),
              "rows": rows}
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    table = Table(title=f"provisioning ablation: {size_mib} MiB per hand-off, {chunk_kib} KiB chunks, "
                        f"median of {repeats} (AES-GCM 1 core {aes / 1e9:.2f} GB/s, memcpy {copy / 1e9:.2f} GB/s)")
    for col in ("configuration", "GB/s", "of 1 AES core", "vs conventional", "time saved"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in rows:
        table.add_row(r["config"], f"{r['gb_s']:.2f}", f"{r['fraction_of_aes_core']:.0%}",
                      f"{r['speedup_vs_conventional']:.2f}x", f"{r['time_saved_vs_conventional_pct']:.0f}%")
    Console().print(table)
