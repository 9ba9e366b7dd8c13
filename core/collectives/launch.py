"""Start a job of real ``torch.distributed`` processes on this machine (tests, benchmarks, demos).

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes, rendezvous them on
127.0.0.1 with a free port, runs ``fn(ctx, *args)`` in each and returns every rank's result. A rank
that raises makes the call raise ``WorkerError`` naming every failed rank and its error; a job past
``timeout`` is killed. ``fn`` must be importable (module level), as with any spawn start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gputravel.core.errors import ConfigError, WorkerError

__all__ = ["WorkerContext", "WorkerError", "check_backend", "free_port", "run_workers"]

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker gets: its rank, the job size, and a queue for progress messages to the parent."""

    rank: int
    world_size: int
    progress: Any  # multiprocessing queue: put(("progress", payload)) from any rank

    def report(self, payload: Any) -> None:
        self.progress.put(("progress", self.rank, payload))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def visible_gpus() -> int:
    """CUDA devices this process may use (0 without CUDA); asks the driver without creating a context."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (ImportError, RuntimeError):
        return 0


def check_backend(backend: str, world_size: int, *, gpus: int | None = None) -> None:
    """Refuse a job that cannot start, before any rank is spawned: an unknown backend, or NCCL with more
    ranks than visible GPUs (NCCL needs one GPU per rank; two ranks on one GPU die with "Duplicate GPU
    detected" inside ``init_process_group``)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, not {world_size}")
    if backend == "nccl":
        have = visible_gpus() if gpus is None else gpus
        if world_size > have:
            raise ConfigError(f"NCCL needs one GPU per rank: world size {world_size} but {have} visible GPU"
                              f"{'' if have == 1 else 's'}; use --backend gloo (CPU tensors, any number of "
                              "ranks) or fewer ranks")


def _entry(rank: int, world: int, port: int, backend: str, timeout_s: float, threads: int,
           fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        device_id = None
        if backend == "nccl":  # one GPU per rank, picked by LOCAL_RANK as under torchrun (checked before spawning)
            device_id = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=device_id)
        try:
            result = fn(WorkerContext(rank, world, out), *args)
        finally:
            dist.destroy_process_group()
        out.put(("done", rank, result))
    except BaseException as exc:  # reported to the parent, which raises
        out.put(("error", rank, (type(exc).__name__, str(exc), traceback.format_exc())))


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    threads: int = 1,
    on_progress: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` spawned ranks and return their results by rank.

    Raises ``ConfigError`` before spawning when the backend cannot run ``world_size`` ranks here."""
    check_backend(backend, world_size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, pg_timeout, threads, fn, args, out),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    tracebacks: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError({r: ("TimeoutError", f"no result after {timeout:g} s")
                                   for r in range(world_size) if r not in results and r not in errors})
            try:
                kind, rank, payload = out.get(timeout=min(0.2, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                for r in dead:
                    errors[r] = ("ProcessDied", f"exit code {procs[r].exitcode}")
                continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(rank, payload)
            elif kind == "done":
                results[rank] = payload
            else:
                errors[rank] = (payload[0], payload[1])
                tracebacks.append(f"--- rank {rank}\n{payload[2]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise WorkerError(errors, "\n".join(tracebacks))
    return [results[r] for r in range(world_size)]
