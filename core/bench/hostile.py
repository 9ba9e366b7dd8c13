"""``bench hostile``'s study (issue 24's Numbers): provisioning with hostile local users on every listener.

A quiet sitting and a hostile sitting, one after the other on the same machine: each starts an emulated
device (its private Unix socket and its TCP data port), a local holder agent, and makes ``handoffs`` real
hand-offs (the engine's own hand-off code, ``gputravel.core.travel.handoff``) of ``size`` bytes over the
TCP data port (``--path direct-tcp``, what any local user can reach) or the Unix socket (``direct``).
In the hostile sitting an attacker process (uid ``nobody`` when run as root, like another local user) keeps
``connections`` connections open on every port the device listens on for the whole sitting: each one
trickles a byte now and then, sends garbage first frames or a DATA_OPEN with a guessed session, and is
reopened as soon as the device cuts it off.

Reported: the provisioning rate of each sitting (``quiet_mb_s``, ``hostile_mb_s``, median over the
hand-offs) and their ``ratio``; ``visits_completed`` (hand-offs of the hostile sitting whose window closed
complete, of ``visits``); ``misattributed_rejections``: rejections the device charged to a window (so to an
honest holder: every hand-off here is honest); and what the device refused before admission.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gputravel.core.bench.data import make_dataset
from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.entries import Entries
from gputravel.core.machine import machine_info
from gputravel.core.platform.emulated import EmulatedPlatform
from gputravel.core.travel import handoff as ho
from gputravel.core.travel.local_link import LocalHolderLink

__all__ = ["ATTACKER", "NOBODY", "hostile_study", "sitting"]

NOBODY = 65534

#: the attacker: ``n`` connections per target, each stalling, trickling or sending garbage, reopened when cut
ATTACKER = r"""
import encodings.idna, os, random, socket, sys, time
targets = sys.argv[2:]
n = int(sys.argv[1])
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # another local user
GARBAGE = [b"\x00" * 64, b"GTRV" + os.urandom(60), os.urandom(64)]
def open_one(t):
    try:
        if ":" in t:
            host, port = t.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=2)
        else:
            s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(t)
        s.setblocking(False)
        return s
    except OSError:
        return None
conns = {(t, i): None for t in targets for i in range(n)}
opened = refused = 0
print("ready", os.getuid(), flush=True)
rng = random.Random(1)
while True:
    for k, s in list(conns.items()):
        if s is None:
            s = open_one(k[0])
            if s is None:
                refused += 1
                continue
            opened += 1
            conns[k] = s
        try:
            kind = rng.random()
            if kind < 0.05:
                s.send(GARBAGE[rng.randrange(len(GARBAGE))])
            elif kind < 0.3:
                s.send(b"\x00")  # trickle
            try:
                if s.recv(4096) == b"":
                    raise OSError("closed")
            except BlockingIOError:
                pass
        except OSError:
            s.close()
            conns[k] = None
    time.sleep(0.2)
"""


def _start_attacker(connections: int, targets: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", ATTACKER, str(connections), *targets], stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"the attacker did not start: {line!r}")
    return proc


async def sitting(*, size: int, chunk: int, handoffs: int, workdir: Path, path: str, entries: Entries,
                  hostile: int = 0) -> dict[str, Any]:
    """One sitting: ``handoffs`` hand-offs of ``size`` bytes; with ``hostile`` attacker connections on each
    of the device's listeners for all of it."""
    data = workdir / "holder"
    if not data.exists():
        make_dataset(data, int(size / 0.9) + 64)
    handle = EmulatedPlatform(workdir / f"platform-{hostile}").start(buffer_bytes=size)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors)
    attacker: subprocess.Popen[str] | None = None
    times: list[float] = []
    completed = 0
    try:
        await asyncio.to_thread(client.connect)
        if hostile:
            targets = [handle.socket_path]
            if handle.data_port is not None:
                targets.append(f"{handle.data_host}:{handle.data_port}")
            attacker = _start_attacker(hostile, targets)
            await asyncio.sleep(1.0)  # every listener's budget of strangers is full before the first hand-off
        link = LocalHolderLink("honest", data, agent=entries.agent())
        await link.start()
        endpoint = ho.data_endpoint(handle, data_path="direct",
                                    transport="inventory" if path == "direct-tcp" else "local")
        for epoch in range(1, handoffs + 1):
            handoff, _ = await ho.open_window(client, epoch=epoch, skip=0, length=size, chunk_size=chunk,
                                              train=(0, size), val=(0, 0))
            t0 = time.perf_counter()
            try:
                await ho.provision(client, link, handoff, device_socket=handle.socket_path, endpoint=endpoint)
                elapsed = time.perf_counter() - t0
                closed = await ho.close_window(client, handoff)
                if closed.complete:
                    completed += 1
                    times.append(elapsed)
            except Exception as exc:  # a failed hand-off is what this study counts
                print(f"bench hostile: hand-off {epoch} failed: {exc}", file=sys.stderr)
                try:
                    await ho.close_window(client, handoff)
                except Exception:
                    pass
        await link.close()
        stats = await asyncio.to_thread(client.stats)
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait(10)
        client.close()
        handle.stop()
    charged = sum(sum(c.values()) for c in stats.rejected_by_epoch.values())
    med = statistics.median(times) if times else float("inf")
    return {"mb_s": round(size / med / 1e6, 1) if times else 0.0, "median_s": round(med, 6) if times else None,
            "visits": handoffs, "visits_completed": completed, "misattributed_rejections": charged,
            "refused_before_admission": dict(stats.refused), "rejected": dict(stats.rejected)}


def hostile_study(*, connections: int, size_mib: int, chunk_kib: int, handoffs: int, workdir: Path,
                  entries: Entries, path: str = "direct-tcp") -> dict[str, Any]:
    """The quiet sitting, then the hostile one, on the same machine; the ratio of their rates."""
    size, chunk = size_mib << 20, chunk_kib << 10
    quiet = asyncio.run(sitting(size=size, chunk=chunk, handoffs=handoffs, workdir=workdir, path=path,
                                entries=entries))
    loud = asyncio.run(sitting(size=size, chunk=chunk, handoffs=handoffs, workdir=workdir, path=path,
                               entries=entries, hostile=connections))
    return {"benchmark": "hostile", "machine": machine_info(), "path": path, "size_mib": size_mib,
            "chunk_kib": chunk_kib, "connections": connections,
            "attacker_uid": NOBODY if os.getuid() == 0 else os.getuid(),
            "quiet_mb_s": quiet["mb_s"], "hostile_mb_s": loud["mb_s"],
            "ratio": round(loud["mb_s"] / quiet["mb_s"], 3) if quiet["mb_s"] else None,
            "visits": loud["visits"], "visits_completed": loud["visits_completed"],
            "misattributed_rejections": quiet["misattributed_rejections"] + loud["misattributed_rejections"],
            "quiet": quiet, "hostile": loud}
