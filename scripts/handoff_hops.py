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

``--set admission`` (task admission15) tables the ``admission``, ``ring_bind`` and ``first_chunk`` stages instead, from
these marks (and ``o_open`` / ``o_done_read`` to bound each visit):

    d_op_begin      device control thread, ``op_handoff`` about to relay (the window just opened)
    d_relayed       device control thread, the HANDOFF written on the holder's parked data connection
    a_rd_HANDOFF, a_main_handoff   as above
    a_parsed        agent main thread, ``Handoff.from_wire`` done
    a_taken         ``RelayedCopies.take`` done
    a_accepted      ``HolderAttestation.accept`` done (the key unwrapped)
    a_witness       ``HolderRecords.keep_witness`` done
    a_checked       ``provision``: the window's bounds and the dataset's files checked
    a_admit_made    ``_data_conn``: ``Admission.make`` done
    a_admit_sent    the admission (and the ring's bind) written on the data connection
    a_first_sealed, a_first_sent   the window's first chunk sealed into its slot, its slot id sent
    d_dataopen_read device data thread, the DATA_OPEN read      d_admit_read, d_admitted, d_ring_bound: its steps
    d_chunk_read    device data thread, a chunk's slot id read  d_first_chunk: as above

A mark line may carry two more fields, ``THREAD_CPU_NS PROCESS_CPU_NS`` (``time.thread_time_ns()``,
``time.process_time_ns()`` at the mark): a hop between two marks of one thread then has its CPU time (``cpu_us``: work,
the rest of its wall time waiting: a wake-up, the GIL, a lock), and a hop within one process the CPU of its other threads
meanwhile (``others_cpu_us``).

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
#: ``--set admission``: the relayed HANDOFF to the first chunk in device memory, tiling ``admission`` (from the relay),
#: ``ring_bind`` and ``first_chunk``; beside them (``AGENT_SIDE``) the agent's own way from the admission to its first chunk
ADMISSION_HOPS: tuple[tuple[str, str, str, str], ...] = (
    ("admission", "d_op_begin", "d_relayed", "device: HANDOFF relayed on the parked connection"),
    ("admission", "d_relayed", "a_rd_HANDOFF", "the relayed HANDOFF to the agent's data-reader thread"),
    ("admission", "a_rd_HANDOFF", "a_main_handoff", "agent: reader thread to main thread (inbox)"),
    ("admission", "a_main_handoff", "a_parsed", "agent: Handoff.from_wire"),
    ("admission", "a_parsed", "a_taken", "agent: RelayedCopies.take"),
    ("admission", "a_taken", "a_accepted", "agent: attestation.accept (the key unwrapped)"),
    ("admission", "a_accepted", "a_witness", "agent: records.keep_witness"),
    ("admission", "a_witness", "a_checked", "agent: provision's bounds and dataset checks"),
    ("admission", "a_checked", "a_admit_made", "agent: SendState, RingSpec, Admission.make"),
    ("admission", "a_admit_made", "d_dataopen_read", "the DATA_OPEN to the device's data thread"),
    ("admission", "d_dataopen_read", "d_admit_read", "device: DATA_OPEN parsed, window looked up"),
    ("admission", "d_admit_read", "d_admitted", "device: admission key, MAC, budgets"),
    ("ring_bind", "d_admitted", "d_ring_bound", "device: the ring bound to the epoch"),
    ("first_chunk", "d_ring_bound", "d_chunk_read", "the first chunk's slot id read by the device's data thread"),
    ("first_chunk", "d_chunk_read", "d_first_chunk", "device: the first chunk opened into device memory"),
)
AGENT_SIDE = (("a_main_handoff", "a_admit_sent", "agent: HANDOFF taken to admission sent (admission_agent)"),
              ("a_admit_made", "a_admit_sent", "agent: DATA_OPEN written, the ring bound here"),
              ("a_admit_sent", "a_first_sealed", "agent: the first chunk read and sealed"),
              ("a_first_sealed", "a_first_sent", "agent: its slot id sent"),
              ("a_first_sent", "d_chunk_read", "the slot id to the device's data thread"))

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


def read_cpu(path: Path) -> dict[tuple[str, int], tuple[int, int, int, int]]:
    """Per ``(name, ns)`` mark that carries them: ``(pid, thread, thread CPU ns, process CPU ns)``."""
    out: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and all(p.isdigit() for p in (parts[1], parts[2], parts[4], parts[5])):
            out[(parts[0], int(parts[1]))] = (int(parts[2]), hash(parts[3]), int(parts[4]), int(parts[5]))
    return out


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


def admission_hops_of(visit: list[Mark], cpu: dict[tuple[str, int], tuple[int, int, int, int]]
                      ) -> dict[str, float] | None:
    """One visit's ``--set admission`` hops in µs (``from>to``), with ``from>to cpu`` and ``from>to others`` where
    the marks carry CPU times; None where a mark is missing (its HANDOFF was not relayed)."""
    out: dict[str, float] = {}
    for a, b in [(a, b) for _s, a, b, _w in ADMISSION_HOPS] + [(a, b) for a, b, _w in AGENT_SIDE]:
        t_a = _first(visit, a, visit[0][1])
        t_b = None if t_a is None else _first(visit, b, t_a)
        if t_a is None or t_b is None:
            return None
        out[f"{a}>{b}"] = round((t_b - t_a) / 1e3, 1)
        ca, cb = cpu.get((a, t_a)), cpu.get((b, t_b))
        if ca is not None and cb is not None and ca[0] == cb[0]:
            own = cb[2] - ca[2] if ca[1] == cb[1] else 0
            if ca[1] == cb[1]:
                out[f"{a}>{b} cpu"] = round(own / 1e3, 1)
            out[f"{a}>{b} others"] = round((cb[3] - ca[3] - own) / 1e3, 1)
    return out


def admission_table(path: Path) -> dict[str, Any]:
    """``--set admission``: per hop the median, low and high wall time over the relayed visits, and the median CPU
    (``cpu_us``: of the hop's one thread; ``others_cpu_us``: its process's other threads) where marks carry it."""
    cpu = read_cpu(path)
    vs = visits(read_marks(path))
    rows = [h for h in (admission_hops_of(v, cpu) for v in vs) if h is not None]
    keys = [(s, f"{a}>{b}", w) for s, a, b, w in ADMISSION_HOPS] + [("agent", f"{a}>{b}", w) for a, b, w in AGENT_SIDE]
    hops: list[dict[str, Any]] = []
    for stage, key, what in keys:
        vals = [r[key] for r in rows]
        row: dict[str, Any] = {"stage": stage, "hop": key, "what": what, "values_us": vals,
                               "median_us": round(statistics.median(vals), 1) if vals else None,
                               "min_us": min(vals, default=None), "max_us": max(vals, default=None)}
        for field, suffix in (("cpu_us", " cpu"), ("others_cpu_us", " others")):
            got = [r[key + suffix] for r in rows if key + suffix in r]
            row[field] = round(statistics.median(got), 1) if got else None
        hops.append(row)
    return {"visits": len(vs), "relayed": len(rows), "hops": hops}


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
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:8.1f}"

    lines = [f"visits {got['visits']}, relayed (tabled) {got['relayed']}",
             f"{'stage':11} {'hop':32} {'median':>8} {'min':>8} {'max':>8} {'cpu':>8} {'others':>8}  what"]
    for h in got["hops"]:
        lines.append(f"{h['stage']:11} {h['hop']:32} {num(h['median_us']):>8} {num(h['min_us']):>8} "
                     f"{num(h['max_us']):>8} {num(h.get('cpu_us')):>8} {num(h.get('others_cpu_us')):>8}  {h['what']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("log", type=Path, help="the marks file (NAME NS PID THREAD per line)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--set", choices=("window-done", "admission"), default="window-done",
                    help="which stages' hops: window and done (task fixed13), or admission to the first chunk")
    args = ap.parse_args(argv)
    got = admission_table(args.log) if args.set == "admission" else table(args.log)
    print(json.dumps(got, indent=1) if args.json else render(got))
    return got


if __name__ == "__main__":
    main(sys.argv[1:])
