"""``bench provision``'s study: end-to-end provisioning throughput per data path.

Each measurement is one real hand-off, made by the engine's own hand-off code
(``gputravel.core.travel.handoff``): the emulated device service derives a window key, the holder's
agent (deployed over the loopback SSH server, or a local subprocess) seals its data in chunks and the
device authenticates and decrypts them straight into its buffer. Timed from HANDOFF to DONE. The
single-core AES-256-GCM decrypt rate is measured in the same run, with the same chunk size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gputravel.core.bench.data import make_dataset
from gputravel.core.bench.load import HolderServer, HolderServerFactory
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.entries import Entries
from gputravel.core.errors import DataError
from gputravel.core.machine import WINDOWS, aes_gcm_pair_rate, aes_gcm_rate, machine_info, ring_pipeline_rate
from gputravel.core.platform.emulated import EmulatedPlatform
from gputravel.core.travel import handoff as ho
from gputravel.core.travel.framed_link import Attesting, FramedLink
from gputravel.core.travel.holder_attest import HolderAttestor, SimCvm, holder_args
from gputravel.core.travel.holders import HolderLink
from gputravel.core.travel.local_link import LocalHolderLink

__all__ = ["ABLATION", "PATHS", "STAGES", "ablation_study", "measure_path", "memcpy_rate", "paths_study"]

#: direct: the engine's direct path for a holder on this host, i.e. the shared-memory ring (``shm`` names it
#: explicitly and fails if no ring was used); direct-socket: the same host, chunks in frames on the device's
#: Unix socket; direct-tcp: the TCP data port itself, as a holder on another machine reaches it where the
#: network routes it (inventory ``data_route = "network"``); direct-tcp-forward: the same port through a
#: remote port forward on the holder's SSH connection (``data_route = "forward"``, the inventory's default),
#: so bound by the SSH connection's speed
PATHS = ("direct", "shm", "direct-socket", "direct-tcp", "direct-tcp-forward", "ssh", "local", "conventional")
#: the stages ``bench provision`` times: the agent's (set-up: HANDOFF read to its first seal, the ring's bind
#: included; data: first seal to last acknowledgement; within it, read and seal, and wait for
#: acknowledgements) and the device's (open: authenticate and decrypt; staging_wait: for a free staging
#: slot; h2d: host to device copy)
STAGES = ("setup_s", "data_s", "read_seal_s", "wait_s", "open_s", "staging_wait_s", "h2d_s")
_AGENT_STAGES = ("setup_s", "data_s", "read_seal_s", "wait_s")
_DEVICE_STAGES = {"open_ns": "open_s", "staging_wait_ns": "staging_wait_s", "h2d_ns": "h2d_s"}
#: CPU seconds per hand-off, by end (``cpu_s`` in a row): each process's CPU time over the hand-off (every thread;
#: the agent's from HANDOFF read to DONE, the device's between two ``stats`` calls around the hand-off, so its
#: window's opening and RETURN included) and the part of it inside the cipher calls (the agent's seal calls,
#: which also read the window's pages; the device's open calls)
_AGENT_CPU = {"agent": "cpu_s", "agent_cipher": "seal_cpu_s"}
_DEVICE_CPU = {"device": "cpu_ns", "device_cipher": "open_cpu_ns"}

#: The Fastrack-style ablation: (label, path, parallel_auth, overlap)
ABLATION = (
    ("travelling: direct + parallel auth + overlap", "direct", True, True),
    ("travelling: direct + overlap (no parallel auth)", "direct", False, True),
    ("travelling: direct only (serial receive/decrypt)", "direct", False, False),
    ("travelling over the SSH channel (no direct path)", "ssh", True, True),
    ("conventional: SSH + CPU re-encryption + device decrypt", "conventional", True, True),
)

#: (a task's label, how many hand-offs it makes) -> the function to call after each one
ProgressFactory = Callable[[str, int], Callable[[], None]]


def memcpy_rate(size: int, *, seconds: float = 0.3) -> float:
    """Plain host memory copy rate (bytes/s): the floor any path is compared with."""
    src = bytearray(os.urandom(1 << 20)) * (size >> 20 or 1)
    dst = bytearray(len(src))
    best = 0.0
    for _ in range(WINDOWS):  # the best window: a busy machine only ever lowers one
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / WINDOWS or not n:
            memoryview(dst)[:] = src
            n += 1
        best = max(best, n * len(src) / (time.perf_counter() - t0))
    return best


def _route(path: str) -> tuple[str, str]:
    """A bench path as the engine's (data path, transport) pair, for ``handoff.data_endpoint``."""
    if path in ("direct", "shm", "direct-socket"):
        return "direct", "local"  # the device's Unix socket (with a ring unless direct-socket)
    if path in ("direct-tcp", "direct-tcp-forward"):
        return "direct", "inventory"  # its TCP data port
    return ("conventional" if path == "conventional" else "channel"), "local"


async def measure_path(path: str, *, size: int, chunk: int, repeats: int, workdir: Path,
                       server: HolderServerFactory | None,
                       entries: Entries = Entries(), on_handoff: Callable[[], None] | None = None, parallel_auth: bool | None = None,
                       overlap: bool | None = None, probe: dict[str, Any] | None = None,
                       stages: list[dict[str, float]] | None = None, cipher_engine: str = "auto",
                       fixed: list[dict[str, float]] | None = None, attest: bool = True) -> list[float]:
    """Seconds per hand-off of ``size`` bytes on ``path`` (one of ``PATHS``); the local agent is started with
    ``entries.holder_agent``, the SSH server by ``server`` (None: the holder is a local agent on every path, its
    chunks on the same-host routes).

    With ``probe``, also the AES-GCM rate measured inside the device process after the hand-offs
    (``probe["device_aes_b_s"]``): it falls if anything in that process holds the GIL (issue 5's check
    that the data path's process has no busy Python threads), and which engine opened the chunks
    (``probe["cipher_engine"]``: "cpu (cryptography)", "gpu (cuda)", "gpu (simulator)"). With ``stages``, one
    dict of seconds per stage (``STAGES``) per hand-off, and ``probe["rings"]``, hand-offs the device served
    from a shared-memory ring. With ``fixed``, each hand-off's fixed cost by stage (``handoff.fixed_stages``, ms).
    ``attest``: the holder attests the CVM and the GPU before it takes each key, as in a run (SIM evidence)."""
    data = workdir / "holder" / "bench"
    if not data.exists():
        make_dataset(data, int(size / 0.9) + 64)  # the agent holds out 10% for validation
    handle = EmulatedPlatform(workdir / "platform", cipher_engine=cipher_engine).start(buffer_bytes=size)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors)
    ssh: HolderServer | None = None
    times: list[float] = []
    data_path, transport = _route(path)
    try:
        await asyncio.to_thread(client.connect)
        await asyncio.to_thread(client.set_data_path, parallel_auth=parallel_auth, overlap=overlap)
        engine = (await asyncio.to_thread(client.info)).cipher_engine
        if probe is not None:
            probe["cipher_engine"] = engine
        link: HolderLink
        if path == "local" or server is None:
            link = LocalHolderLink("bench", data, agent=entries.agent())
        else:
            ssh = server([("bench", data)], None,
                         data_route="forward" if path == "direct-tcp-forward" else "network")
            link = (await asyncio.to_thread(ssh.start))[0]
        if attest:
            _attach_attestation(link, workdir / "platform", client)
        info = await link.start()
        if info.train_bytes < size:
            raise DataError(f"dataset too small: {info.train_bytes} < {size}")
        endpoint = ho.data_endpoint(handle, data_path=data_path, transport=transport)
        if endpoint is not None and path == "direct-socket":
            endpoint = replace(endpoint, ring=False)
        before = (await asyncio.to_thread(client.stats)).counters
        for epoch in range(1, repeats + 1):
            w0 = time.perf_counter_ns()
            handoff, _ = await ho.open_window(client, epoch=epoch, skip=0, length=size, chunk_size=chunk,
                                              train=(0, size), val=(0, 0), conventional=path == "conventional")
            w1 = time.perf_counter_ns()
            t0 = time.perf_counter()
            done = await ho.provision(client, link, handoff, device_socket=handle.socket_path, endpoint=endpoint)
            times.append(time.perf_counter() - t0)
            closed = await ho.close_window(client, handoff)
            ho.require_complete(closed, size)
            if fixed is not None:
                fixed.append(ho.fixed_stages(window_ns=(w0, w1), stats=done, closed=closed))
            if stages is not None:
                after = (await asyncio.to_thread(client.stats)).counters
                row = {k: float(done.stages.get(k, 0.0)) for k in _AGENT_STAGES}
                row.update({name: (after.get(k, 0) - before.get(k, 0)) / 1e9 for k, name in _DEVICE_STAGES.items()})
                row.update({f"cpu.{name}": float(done.stages.get(k, 0.0)) for name, k in _AGENT_CPU.items()})
                row.update({f"cpu.{name}": (after.get(k, 0) - before.get(k, 0)) / 1e9 for name, k in _DEVICE_CPU.items()})
                stages.append(row)
                before = after
            if on_handoff is not None:
                on_handoff()
        await link.close()
        rings = int((await asyncio.to_thread(client.stats)).counters.get("rings_bound", 0))
        if path == "shm" and rings < repeats:
            raise DataError(f"the shm path made {rings} rings for {repeats} hand-offs: no shared-memory ring here")
        if probe is not None:
            probe["rings"] = rings
            probe["device_aes_b_s"] = (await asyncio.to_thread(client.aes_rate, chunk=chunk)).bytes_per_s
    finally:
        if ssh is not None:
            ssh.stop()
        client.close()
        handle.stop()
    return times


def _cpu_row(per: list[dict[str, float]]) -> dict[str, float]:
    """``cpu_s`` of a row: each end's CPU per hand-off, in its cipher calls and beyond them (medians)."""
    out: dict[str, float] = {}
    for end in ("agent", "device"):
        whole = [r[f"cpu.{end}"] for r in per]
        cipher = [r[f"cpu.{end}_cipher"] for r in per]
        out[end] = round(statistics.median(whole), 6)
        out[f"{end}_cipher"] = round(statistics.median(cipher), 6)
        out[f"{end}_beyond_cipher"] = round(statistics.median(w - c for w, c in zip(whole, cipher, strict=True)), 6)
    return out


def _attach_attestation(link: HolderLink, platform_dir: Path, client: DeviceClient) -> None:
    """The holder's own attestation on ``link`` as a run wires it (``holder_setup.attach``): the SIM CVM of the
    bench's platform, the agent started with the SIM policy and golden measurements."""
    if not isinstance(link, FramedLink):
        return
    link.session.attestor = HolderAttestor(run_id="bench", cvm=SimCvm.load(platform_dir), client=lambda: client)
    if isinstance(link, Attesting) and link.attest_files is None:
        link.attest_files = holder_args(platform_dir)


def paths_study(paths: list[str], *, size_mib: int, chunk_kib: int, repeats: int, workdir: Path,
                server: HolderServerFactory, entries: Entries = Entries(),
                progress: ProgressFactory | None = None, cipher_engine: str = "auto") -> dict[str, Any]:
    """MB/s per data path, next to the single-core AES-GCM rate (standalone and inside the device);
    ``cipher_engine`` (auto, cpu, gpu) is who opens the chunks on the device, named in every row."""
    size, chunk = size_mib << 20, chunk_kib << 10
    aes = aes_gcm_rate(chunk)
    # the ceilings of this machine, measured before the paths: a plain copy of ``size`` bytes, and one
    # seal pass and one open pass of ``size`` bytes running at once (no protocol between them)
    copy = memcpy_rate(size)
    pair = aes_gcm_pair_rate(size, chunk)
    ceiling = min(pair.values())
    pipeline = ring_pipeline_rate(size, chunk)
    meds: list[float] = []
    in_device: list[float] = []
    rows: list[dict[str, Any]] = []
    for p in paths:
        tick = progress(f"{p}: {repeats} × {size_mib} MiB", repeats) if progress else None
        probe: dict[str, Any] = {}
        per: list[dict[str, float]] = []
        fixed: list[dict[str, float]] = []
        times = asyncio.run(measure_path(p, size=size, chunk=chunk, repeats=repeats, workdir=workdir, server=server,
                                         entries=entries, on_handoff=tick, probe=probe, stages=per,
                                         cipher_engine=cipher_engine, fixed=fixed))
        in_device.append(probe["device_aes_b_s"])
        med = statistics.median(times)
        meds.append(med)
        data_s = statistics.median(r["data_s"] for r in per)
        rows.append({"path": p, "size_mib": size_mib, "chunk_kib": chunk_kib, "repeats": repeats,
                     "median_s": round(med, 6), "min_s": round(min(times), 6),
                     "mb_s": round(size / med / 1e6, 1), "best_mb_s": round(size / min(times) / 1e6, 1),

                     "fraction_of_pair_ceiling": round(size / med / ceiling, 3),
                     "fraction_of_ring_pipeline": round(size / med / pipeline["median"], 3),
                     # the hand-off split in two: the data phase (the agent's first seal to its last
                     # acknowledgement) and the fixed cost around it (HANDOFF and DONE over the holder's link,
                     # the agent's set-up and the ring's bind), the median over the hand-offs
                     "data_phase_s": round(data_s, 6),
                     "data_phase_mb_s": round(size / data_s / 1e6, 1) if data_s > 0 else None,
                     "fixed_s": round(statistics.median(t - r["data_s"] for t, r in zip(times, per, strict=True)), 6),
                     # the fixed cost by stage, ms, the median over the hand-offs (``handoff.FIXED_STAGES``; the
                     # window's key is asked for before the hand-off's clock starts, so ``window`` is outside
                     # median_s and fixed_s, the others inside)
                     "fixed_stages_ms": {k: round(statistics.median(f[k] for f in fixed), 4)
                                         for k in (*ho.FIXED_STAGES, "total", "data", "wall", *ho.STAGE_PARTS)},
                     "cipher_engine": probe.get("cipher_engine"),
                     "shm_ring": probe.get("rings", 0) >= repeats,
                     # seconds per hand-off in each stage (median over the hand-offs); stages overlap, so they
                     # need not add up to median_s: the largest one is the stage that binds
                     "stages": {k: round(statistics.median(r[k] for r in per), 6) for k in STAGES},
                     # CPU seconds per hand-off by end (median over the hand-offs): the whole process, the part in
                     # the cipher calls, and the rest (framing, wake-ups, checks, bookkeeping: what is not AES-GCM)
                     "cpu_s": _cpu_row(per)})
    # one core and a copy measured again after the paths, the better of the two kept (a ceiling: a busy machine
    # only ever lowers a measurement); each row against the machine's limit measured in this run (``bound``: the
    # lowest of one AES-GCM core, the pair ceiling and memcpy)
    aes, copy = max(aes, aes_gcm_rate(chunk)), max(copy, memcpy_rate(size))
    limits = {"aes_gcm_1core": aes, "pair_ceiling": ceiling, "memcpy": copy}
    bound_name = min(limits, key=lambda k: limits[k])
    for row, med in zip(rows, meds, strict=True):
        row.update({"fraction_of_aes_core": round(size / med / aes, 3), "bound": bound_name,
                    "bound_mb_s": round(limits[bound_name] / 1e6, 1),
                    "fraction_of_bound": round(size / med / limits[bound_name], 3)})
    by = {r["path"]: r for r in rows}
    device_aes = statistics.median(in_device)
    result: dict[str, Any] = {
        "benchmark": "provision", "machine": machine_info(), "aes_gcm_1core_mb_s": round(aes / 1e6, 1),
        # the same measurement inside the device service's process: a busy Python thread there
        # would hold the GIL between AES-GCM calls and pull this below the standalone rate
        "aes_gcm_in_device_mb_s": round(device_aes / 1e6, 1),
        "device_aes_vs_standalone": round(device_aes / aes, 3),
        # what binds a seal-then-open pipeline on this machine (docs/provisioning.md): the rate of one seal
        # pass and one open pass of the same bytes run at once by two processes, and a plain memory copy
        "aes_gcm_pair_mb_s": {"seal": round(pair["seal"] / 1e6, 1), "open": round(pair["open"] / 1e6, 1)},
        "pair_ceiling_mb_s": round(ceiling / 1e6, 1),
        "pair_ceiling_of_aes_core": round(ceiling / aes, 3),
        "memcpy_mb_s": round(copy / 1e6, 1),
        # a bare seal -> shared ring -> open pipeline between two processes, no protocol (best and median
        # round): the most any same-host ring path reaches on this machine
        "ring_pipeline_mb_s": {k: round(v / 1e6, 1) for k, v in pipeline.items()},
        "ring_pipeline_of_aes_core": round(pipeline["best"] / aes, 3),
        "rows": rows}
    if "ssh" in by:  # each direct route against the SSH channel, from the same run
        for p, key in (("direct", "direct_vs_ssh"), ("direct-tcp", "direct_tcp_vs_ssh"),
                       ("direct-tcp-forward", "direct_tcp_forward_vs_ssh")):
            if p in by:  # from the medians, not the rounded MB/s (at 2 MB/s, a loaded machine's, 0.1 is 5 %)
                result[key] = round(by["ssh"]["median_s"] / by[p]["median_s"], 2)
    return result


def ablation_study(*, size_mib: int, chunk_kib: int, repeats: int, workdir: Path, server: HolderServerFactory,
                   entries: Entries = Entries(), progress: ProgressFactory | None = None) -> dict[str, Any]:
    """The Fastrack-style table: each optimisation on and off, the conventional path, a memory copy."""
    size, chunk = size_mib << 20, chunk_kib << 10
    rows: list[dict[str, Any]] = []
    aes = aes_gcm_rate(chunk)
    copy = memcpy_rate(size)
    for label, p, par, ovl in ABLATION:
        tick = progress(label, repeats) if progress else None
        seen: dict[str, Any] = {}
        times = asyncio.run(measure_path(p, size=size, chunk=chunk, repeats=repeats, workdir=workdir, server=server,
                                         entries=entries, on_handoff=tick, parallel_auth=par, overlap=ovl, probe=seen))
        med = statistics.median(times)
        rows.append({"config": label, "path": p, "parallel_auth": par, "overlap": ovl,
                     "median_s": round(med, 6), "min_s": round(min(times), 6),
                     "gb_s": round(size / med / 1e9, 3), "fraction_of_aes_core": round(size / med / aes, 3),
                     "cipher_engine": seen.get("cipher_engine")})
    base = next(r for r in rows if r["path"] == "conventional")
    for r in rows:
        r["speedup_vs_conventional"] = round(base["median_s"] / r["median_s"], 2)
        r["time_saved_vs_conventional_pct"] = round(100 * (1 - r["median_s"] / base["median_s"]), 1)
    return {"benchmark": "provision-ablation", "machine": machine_info(), "size_mib": size_mib,
            "chunk_kib": chunk_kib, "repeats": repeats, "aes_gcm_1core_gb_s": round(aes / 1e9, 3),
            "memcpy_gb_s": round(copy / 1e9, 3), "rows": rows}
