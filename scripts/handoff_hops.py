"""Issue 34 item 2: a relayed hand-off's ``window`` and ``done`` stages hop by hop, between threads and processes,
from a log of ``perf_counter_ns`` marks (CLOCK_MONOTONIC: one clock for every process on one host, which only this
diagnosis relies on).

The marks are temporary instrumentation, not part of the code: each process appends ``NAME NS PID THREAD`` lines to
one file at these places (task fixed13 put them in by hand, ran ``bench travel`` and took them out again):

    o_open          orchestrator loop, ``HandoffWindows.open`` begins (the ``window`` stage's start)
    o_req_written   orchestrator loop, the window's request sealed and written (``LoopCaller.call``)
    d_req_read      device control thread, a request read (``serve_control``)
    d_op_begin      device control thread, ``op_handoff`` begins
    a_rd_HANDOFF    agent data-reader thread, the relayed HANDOFF read (``DataConn._reader``)
    a_main_handoff  agent main thread, the HANDOFF taken from the inbox (``Agent.handoff``)
    a_first_sent    agent main thread, its first chunk sealed and handed to the connection
    d_first_chunk   device opener, the first chunk in device memory (``ChunkIntake``)
    d_op_end, d_ans_written, o_readable, o_grant: the grant's way back (overlaps the data)
    d_last_chunk    device opener, the window's last chunk in device memory
    d_acks_sent     device data thread, an acknowledgement frame written (``_send_acks``)
    a_rd_ACK        agent data-reader thread, an acknowledgement read
    a_last_ack      agent main thread, the acknowledgement that completed the window taken from the inbox
    a_done_written  agent main thread, DONE written and flushed to its stdout (the SSH channel)
    s_pipe_rx       SSH server process, the agent's stdout read (asyncssh's pipe reader)
    o_ssh_rx        orchestrator, asyncssh's connection receives bytes (before decryption)
    o_done_read     orchestrator loop, DONE parsed (``_provision_direct``: the ``done`` stage's end)

    .venv/bin/python scripts/handoff_hops.py /tmp/hops.log [--json]

Each hop is from the first ``from`` mark of the visit to the first ``to`` mark after it. A visit starts at
``o_open`` and ends at its ``o_done_read``; one whose HANDOFF was not relayed (a holder's first) is counted, not
tabled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: (stage, from mark, to mark, what the hop is)
HOPS: tuple[tuple[str, str, str, str], ...] = (
    ("window", "o_open", "o_req_written", "orchestrator loop: HANDOFF built and wrapped, request sealed and written"),
    ("window", "o_req_written", "d_req_read", "request to the device's control thread"),
    ("window", "d_req_read", "d_op_begin", "device: request opened and dispatched"),
    ("window", "d_op_begin", "a_rd_HANDOFF", "device: window opened, HANDOFF relayed to the agent's reader thread"),
    ("window", "a_rd_HANDOFF", "a_main_handoff", "agent: reader thread to main thread (inbox)"),
    ("window", "a_main_handoff", "a_first_sent", "agent: key taken, admitted, first chunk sealed and sent"),
    ("window", "a_first_sent", "d_first_chunk", "first chunk to device memory"),
    ("done", "d_last_chunk", "d_acks_sent", "device: last chunk opened to its acknowledgement written"),
    ("done", "d_acks_sent", "a_rd_ACK", "acknowledgement to the agent's reader thread"),
    ("done", "a_rd_ACK", "a_last_ack", "agent: reader thread to main thread (inbox)"),
    ("done", "a_last_ack", "a_done_written", "agent: DONE built, written and flushed"),
    ("done", "a_done_written", "s_pipe_rx", "agent's stdout pipe to the SSH server process"),
    ("done", "s_pipe_rx", "o_ssh_rx", "SSH server: read, sealed, sent to the orchestrator's socket"),
    ("done", "o_ssh_rx", "o_done_read", "orchestrator: asyncssh opens it, the loop's reader wakes, DONE parsed"),
)
#: the grant's way back: not on the data's path once the HANDOFF is relayed (reported beside the hops)
GRANT = (("d_op_begin", "d_ans_written"), ("d_ans_written", "o_readable"), ("o_readable", "o_grant"))

Mark = tuple[str, int]


def read_marks(path: Path) -> list[Mark]:
    """``(name, ns)`` in time order; a line that is not ``NAME NS ...`` is a ``ValueError`` naming it."""
    marks: list[Mark] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"{path}:{n}: not a mark line (NAME NS PID THREAD): {line!r}")
        marks.append((parts[0], int(parts[1])))
    marks.sort(key=lambda m: m[1])
    return marks


def visits(marks: list[Mark]) -> list[list[Mark]]:
    """The marks from each ``o_open`` to the ``o_done_read`` that ends it."""
    out: list[list[Mark]] = []
    cur: list[Mark] | None = None
    for m in marks:
        if m[0] == "o_open":
            cur = [m]
        elif cur is not None:
            cur.append(m)
            if m[0] == "o_done_read":
                out.append(cur)
                cur = None
    return out


def _first(marks: list[Mark], name: str, after: int) -> int | None:
    return next((ns for n, ns in marks if n == name and ns >= after), None)


def hops_of(visit: list[Mark]) -> dict[str, float] | None:
    """One visit's hops in µs (keys ``from>to``), or None where a mark is missing (its HANDOFF was not relayed)."""
    out: dict[str, float] = {}
    for pairs in ([(a, b) for _s, a, b, _w in HOPS], list(GRANT)):
        for a, b in pairs:
            t_a = _first(visit, a, visit[0][1])
            t_b = None if t_a is None else _first(visit, b, t_a)
            if t_a is None or t_b is None:
                return None
            out[f"{a}>{b}"] = round((t_b - t_a) / 1e3, 1)
    first = _first(visit, "d_first_chunk", visit[0][1])
    last = _first(visit, "d_last_chunk", visit[0][1])
    if first is None or last is None:
        return None
    out["window_us"] = round((first - visit[0][1]) / 1e3, 1)
    out["done_us"] = round((visit[-1][1] - last) / 1e3, 1)
    return out


def table(path: Path) -> dict[str, Any]:
    """Per hop the median, low and high over the relayed visits in ``path``'s marks, and each visit's values."""
    rows = [h for h in (hops_of(v) for v in visits(read_marks(path))) if h is not None]
    n_visits = len(visits(read_marks(path)))
    hops: list[dict[str, Any]] = []
    keys = [(s, f"{a}>{b}", w) for s, a, b, w in HOPS] + [("grant", f"{a}>{b}", "the grant's way back")
                                                           for a, b in GRANT]
    keys += [("window", "window_us", "window: o_open to the first chunk in device memory"),
             ("done", "done_us", "done: the last chunk in device memory to DONE parsed")]
    for stage, key, what in keys:
        vals = [r[key] for r in rows]
        hops.append({"stage": stage, "hop": key, "what": what, "values_us": vals,
                     "median_us": round(statistics.median(vals), 1) if vals else None,
                     "min_us": min(vals, default=None), "max_us": max(vals, default=None)})
    return {"visits": n_visits, "relayed": len(rows), "hops": hops}


def render(got: dict[str, Any]) -> str:
    lines = [f"visits {got['visits']}, relayed (tabled) {got['relayed']}",
             f"{'stage':7} {'hop':32} {'median':>8} {'min':>8} {'max':>8}  what"]
    for h in got["hops"]:
        med = "-" if h["median_us"] is None else f"{h['median_us']:8.1f}"
        lo = "-" if h["min_us"] is None else f"{h['min_us']:8.1f}"
        hi = "-" if h["max_us"] is None else f"{h['max_us']:8.1f}"
        lines.append(f"{h['stage']:7} {h['hop']:32} {med:>8} {lo:>8} {hi:>8}  {h['what']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("log", type=Path, help="the marks file (NAME NS PID THREAD per line)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    got = table(args.log)
    print(json.dumps(got, indent=1) if args.json else render(got))
    return got


if __name__ == "__main__":
    main(sys.argv[1:])
