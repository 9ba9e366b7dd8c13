"""Issue 34 item 2: the window's key asked from the event loop (``DeviceClient.on_loop.handoff``) against the same
request through a worker thread (``asyncio.to_thread(client.handoff)``, what the hand-off did before), on one real
device process, the two taken in turn so both meet the same load. Times the request alone (no holder, no data: the
``window`` stage without the data it overlaps in a run), from the caller's ``await`` to the grant back on the loop.

    .venv/bin/python scripts/window_call_ab.py --rounds 200

Prints JSON: per variant the median, 10th and 90th percentile in µs, and the share of rounds in which the loop call
was the faster of its pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gputravel.core.deviceclient.client import DeviceClient
from gputravel.core.platform.emulated import EmulatedPlatform


async def _study(client: DeviceClient, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"to_thread": [], "on_loop": []}
    wins = 0
    epoch = 0
    for i in range(rounds):
        pair: dict[str, float] = {}
        for variant in (("to_thread", "on_loop") if i % 2 else ("on_loop", "to_thread")):
            epoch += 1
            t0 = time.perf_counter_ns()
            if variant == "on_loop":
                await client.on_loop.handoff(epoch=epoch, offset=0, length=1 << 20, chunk_size=1 << 20)
            else:
                await asyncio.to_thread(client.handoff, epoch=epoch, offset=0, length=1 << 20, chunk_size=1 << 20)
            pair[variant] = (time.perf_counter_ns() - t0) / 1e3
            client.close_window(epoch=epoch)
        for k, v in pair.items():
            times[k].append(v)
        wins += pair["on_loop"] < pair["to_thread"]
    out: dict[str, Any] = {}
    for k, v in times.items():
        q = statistics.quantiles(v, n=10)
        out[k] = {"median_us": round(statistics.median(v), 1), "p10_us": round(q[0], 1), "p90_us": round(q[-1], 1)}
    out["on_loop_faster_share"] = round(wins / rounds, 3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="window-ab-"))
    handle = EmulatedPlatform(state).start(buffer_bytes=2 << 20)
    client = DeviceClient(handle.socket_path, anchors=handle.anchors, timeout=30.0)
    try:
        client.connect()
        load = os.getloadavg()
        result = asyncio.run(_study(client, args.rounds))
        result.update({"rounds": args.rounds, "loadavg_before": [round(x, 2) for x in load],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
        print(json.dumps(result, indent=1))
        return result
    finally:
        try:
            client.shutdown()
        finally:
            client.close()
            handle.stop()


if __name__ == "__main__":
    main()
